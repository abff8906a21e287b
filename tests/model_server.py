"""A real OpenAI-compatible model server for tests: llama-cpp-python's, serving a tiny
random-weight llama model written at test time with the `gguf` package.

llama-cpp-python builds llama.cpp from source when installed (about 13 minutes on two
cores, once per machine: pip keeps the wheel), so it is an extra of its own,
`pip install -e '.[model-server]'`, which `.ci/run` installs. Where it is missing the tests
that need it skip saying so, unless `TURNKEEPER_TEST_REQUIRE_MODEL_SERVER` is set (CI
sets it): then they fail, so that CI never passes by skipping them.

The model's vocabulary is the 256 bytes, three control tokens and a few word pieces: a
prompt costs about a token a byte. Its answers are noise, and that is all a test of the
daemon needs from it: a real server's token counts, context-length errors and outages.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support import free_port, plain

REQUIRED = "TURNKEEPER_TEST_REQUIRE_MODEL_SERVER"
MISSING = (
    "llama-cpp-python is not installed: pip install -e '.[model-server]' (it builds "
    "llama.cpp from source, about 13 minutes on two cores)"
)
EOS_LOGIT = 1.0  # the end-of-text token's lead over the others, in logits
WORDS = ["▁the", "▁a", "▁and", "▁t", "▁to", "e", "t", "a", "o", "▁"]
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"


def require() -> None:
    """Skip (or, where CI requires it, fail) when the server cannot be run here."""
    missing = [m for m in ("llama_cpp", "gguf") if importlib.util.find_spec(m) is None]
    if not missing:
        return
    if os.environ.get(REQUIRED):
        pytest.fail(f"{REQUIRED} is set, but {MISSING}")
    pytest.skip(MISSING)


def write_model(path: Path, seed: int = 0) -> Path:
    """A tiny llama model with random weights (about 0.5 MB), written to `path`."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    n_embd, n_layer, n_head, n_ff = 64, 2, 4, 128
    tokens = [b"<unk>", b"<s>", b"</s>", *(f"<0x{i:02X}>".encode() for i in range(256))]
    tokens += [word.encode() for word in WORDS]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * len(WORDS)
    writer.add_name("turnkeeper-test-tiny")
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(WORDS))])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(TEMPLATE)

    def weights(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    def ones(name: str) -> None:
        writer.add_tensor(name, np.ones(n_embd, dtype=np.float32))

    # Every token's embedding leans one way (dimension 0), and so does the last hidden
    # state after the norm (about sqrt(n_embd) there): the end-of-text token's row
    # reads that dimension, so an answer ends after a few tokens, as a chat model's does.
    embeddings = (rng.standard_normal((len(tokens), n_embd)) * 0.02).astype(np.float32)
    embeddings[:, 0] = 1.0
    writer.add_tensor("token_embd.weight", embeddings)
    for i in range(n_layer):
        ones(f"blk.{i}.attn_norm.weight")
        for part in ("q", "k", "v", "output"):
            weights(f"blk.{i}.attn_{part}.weight", n_embd, n_embd)
        ones(f"blk.{i}.ffn_norm.weight")
        weights(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        weights(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        weights(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    ones("output_norm.weight")
    output = (rng.standard_normal((len(tokens), n_embd)) * 0.02).astype(np.float32)
    output[:, 0] = 0.0
    output[2, 0] = EOS_LOGIT / np.sqrt(n_embd)
    writer.add_tensor("output.weight", output)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class ModelServer:
    """`python -m llama_cpp.server` on a loopback port, with a `n_ctx`-token window;
    `stop` and `start` again keep its port (an outage and the server's return)."""

    def __init__(self, root: Path, n_ctx: int) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.model = write_model(root / "tiny.gguf")
        self.n_ctx = n_ctx
        self.port = free_port()
        self.log = root / "model-server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 60.0) -> ModelServer:
        with self.log.open("ab") as log:
            command = [sys.executable, "-m", "llama_cpp.server", "--model", str(self.model)]
            command += ["--n_ctx", str(self.n_ctx), "--host", "127.0.0.1"]
            command += ["--port", str(self.port)]
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            with contextlib.suppress(httpx.HTTPError), httpx.Client(transport=plain()) as http:
                if http.get(f"{self.base_url}/models", timeout=2).is_success:
                    return self
            time.sleep(0.2)
        raise AssertionError(f"the model server did not start: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        """End the server (by its pid) and wait for it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
