"""The `dflash-iree` command line: the eager reference, refusals without a traceback, and what
`generate` prints."""

from __future__ import annotations

import json
import re
import subprocess
import sys


def dflash(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_iree", *args], capture_output=True, text=True, timeout=300)


def test_eager_drafted_equals_plain_json(target_dir, drafter_dir):
    common = ["eager", "--target", str(target_dir), "--prompt-ids", "7 300 12", "--max-new-tokens", "12",
              "--max-context", "128", "--json"]
    drafted = dflash(*common, "--drafter", str(drafter_dir))
    plain = dflash(*common)
    assert drafted.returncode == 0, drafted.stderr
    d, p = json.loads(drafted.stdout), json.loads(plain.stdout)
    assert d["tokens"] == p["tokens"] and len(d["tokens"]) == 12
    assert d["accepted"] and sum(d["histogram"]) == len(d["accepted"]) and p["accepted"] == []


def test_refusal_is_one_line_without_traceback(tmp_path, target_dir):
    r = dflash("eager", "--target", str(tmp_path), "--prompt-ids", "1")
    assert r.returncode == 2
    assert "config.json does not exist" in r.stderr and "Traceback" not in r.stderr


def test_over_long_request_is_refused(target_dir):
    r = dflash("eager", "--target", str(target_dir), "--prompt-ids", "1 2 3", "--max-new-tokens", "100",
               "--max-context", "64")
    assert r.returncode == 2 and "exceeds max_context 64" in r.stderr and "Traceback" not in r.stderr


def test_bad_sampling_is_refused(target_dir):
    r = dflash("eager", "--target", str(target_dir), "--prompt-ids", "1", "--top-p", "1.5")
    assert r.returncode == 2 and "top_p 1.5 is out of range" in r.stderr


def test_generate_prints_the_text_then_a_summary_on_stderr(host_artifacts):
    """Without --json stdout holds only the text (token ids: the tiny target has no tokenizer) and
    stderr one summary line: tokens, τ over rounds when drafted, tok/s, the first token's ms and the
    rest's; --quiet leaves stderr empty."""
    common = ["generate", "--artifacts", str(host_artifacts), "--prompt-ids", "7 300 12", "--max-new-tokens", "10"]
    want = json.loads(dflash(*common, "--json").stdout)["tokens"]
    ms = r"[\d.]+ tok/s; first token [\d.]+ ms, then \d+ tokens in [\d.]+ ms\]\n"
    drafted = r"tau \d\.\d\d over \d+ rounds"
    for extra, how in [((), drafted), (("--no-draft",), "plain decoding"), (("--draft-top-k", "2"), drafted)]:
        r = dflash(*common, *extra)
        assert r.returncode == 0, r.stderr
        assert r.stdout == " ".join(map(str, want)) + "\n"
        assert re.search(rf"(^|\n)\[10 tokens, {how}, {ms}$", r.stderr), r.stderr
    quiet = dflash(*common, "--quiet")
    assert quiet.returncode == 0 and quiet.stdout == " ".join(map(str, want)) + "\n" and quiet.stderr == ""
