"""`python -m supervisor` is the `turnkeeper` command."""

from supervisor.cli.main import main

if __name__ == "__main__":
    main()
