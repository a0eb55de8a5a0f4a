"""`dflash-iree bench` on the tiny host artifacts: the JSON it writes and the same-token check."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_cli_writes_json(host_artifacts, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_ids": p}) for p in ([7, 300, 12], list(range(40, 60)))) + "\n")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "dflash_iree", "bench", "--artifacts", str(host_artifacts), "--prompts",
                        str(prompts), "--max-new-tokens", "16", "--runs", "2", "--json", str(out), "--quiet"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["same_tokens"] and result["prompts"] == 2 and result["runs"] == 2
    d = result["dflash"]
    assert sum(d["tau_histogram"]) == d["rounds"] and 1 <= d["tau_mean"] <= 8
    assert result["plain"]["tokens"] == result["dflash"]["tokens"] == 2 * 2 * 16
    assert "speedup dflash/plain" in r.stdout


def test_bench_refuses_a_bad_prompt_file(host_artifacts, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    r = subprocess.run([sys.executable, "-m", "dflash_iree", "bench", "--artifacts", str(host_artifacts), "--prompts",
                        str(bad)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "bad.jsonl:1: expected a JSON object" in r.stderr
