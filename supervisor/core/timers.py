"""When a reconcile loop looks next: at the earliest time one of its rows falls due.

A loop whose rows fall due at times written in the database (a delivery's next try, a
task's lost deadline: its runner's last heartbeat plus `tasks.lost_grace`) rests until the
earliest of them, not until its next sweep. The times are the database's and every boot
passes at once, so a time that falls due after a restart is acted on at that time, as it
would have been without the restart. Pure: the loop reads the times and the clock and
passes them in (docs/architecture.md, "Rules the code keeps").

Rules
-----
- A pass judges its rows by one reading of the database clock, `judged`: the rows due
  before then are that pass's to act on. Their times are not waited for again: a row the
  pass could not act on (no room, an error) waits for a wake or for the loop's sweep, so a
  row that stays due never spins the loop.
- The rest runs from `now` (read after the pass) to the earliest time from `judged` on; none
  if that time has come meanwhile (the next pass is due at once), and at most `longest`,
  the loop's sweep (what no row of this database says: another daemon's writes, a clock
  that jumped).
"""

from __future__ import annotations

from collections.abc import Iterable


def rest(due: Iterable[float | None], *, judged: float, now: float, longest: float) -> float:
    """Seconds from `now` until the earliest of the times `due` from `judged` on (None: a
    row with no time of its own), at most `longest`, never below 0 (see the module's
    rules)."""
    ahead = [moment for moment in due if moment is not None and moment >= judged]
    if not ahead:
        return max(0.0, longest)
    return max(0.0, min(longest, min(ahead) - now))
