"""Helpers of the server tests: a tiny target with a tokenizer and chat template, and a real
`dflash-iree serve` process on 127.0.0.1 (a free port), stopped with SIGTERM."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

# Qwen3's template shape (tests/test_text.py's).
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def chat_target(folder: Path, target_dir: Path) -> Path:
    """target_dir's config and weights with a byte-level BPE tokenizer of 300 ids (below the tiny
    vocabulary of 512) and a chat template: the same compiled artifacts then take text and chat."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(target_dir) / name, folder / name)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(x):\n    return x + 1\n", "hello world, say hi"] * 50, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}))
    return folder


class Server:
    """`python -m dflash_iree serve ARGS --port 0` in a subprocess; `url` once /health is 200.

    stderr is drained by a thread into `log` (the bound port is read from it).
    """

    def __init__(self, *args, ready_timeout: float = 180.0):
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash_iree", "serve", "--port", "0",
                                      "--log-level", "warning", *map(str, args)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.log: list[str] = []
        self._port = threading.Event()
        self.url = ""
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + ready_timeout
        if not self._port.wait(ready_timeout):
            self.stop()
            raise AssertionError(f"the server printed no address:\n{self.stderr}")
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.stderr}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"the server was not healthy within {ready_timeout} s:\n{self.stderr}")

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            m = re.search(r" on (http://127\.0\.0\.1:\d+);", line)
            if m:
                self.url = m.group(1)
                self._port.set()

    @property
    def stderr(self) -> str:
        return "".join(self.log)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then the exit status (killed after `timeout` seconds: a failure)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def metric(text: str, name: str, labels: dict | None = None) -> float | None:
    """A sample's value from Prometheus text, parsed by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and (labels is None or all(s.labels.get(k) == v for k, v in labels.items())):
                return s.value
    return None


def wait_for_metric(url: str, name: str, want: float, headers: dict | None = None, timeout: float = 30.0,
                    labels: dict | None = None) -> str:
    """Poll /metrics until `name` equals `want`; returns the last text (AssertionError on timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
        if metric(text, name, labels) == want or time.monotonic() > deadline:
            assert metric(text, name, labels) == want, f"{name} is {metric(text, name, labels)}, not {want}:\n{text}"
            return text
        time.sleep(0.1)
