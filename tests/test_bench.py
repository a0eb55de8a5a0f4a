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


def test_bench_takes_chat_messages(host_artifacts, target_dir, drafter_dir, tmp_path):
    """Rows of "messages" are rendered with the target's chat template (bench/prompts/chat.jsonl's form)."""
    from serving import chat_target

    from dflash_iree.runtime.bench import read_prompts

    chat = read_prompts("bench/prompts/chat.jsonl")
    assert len(chat) == 32 and all(p[0]["role"] == "user" for p in chat)
    target = chat_target(tmp_path / "chat", target_dir)
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": c}]}) for c in ("hi", "say hello"))
                       + "\n")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "dflash_iree", "bench", "--artifacts", str(host_artifacts), "--target",
                        str(target), "--drafter", str(drafter_dir), "--prompts", str(prompts), "--max-new-tokens", "8",
                        "--runs", "1", "--json", str(out), "--quiet"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["prompts"] == 2


def test_bench_refuses_bad_chat_rows(host_artifacts, target_dir, tmp_path):
    from serving import chat_target

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user"}]}\n')
    r = subprocess.run([sys.executable, "-m", "dflash_iree", "bench", "--artifacts", str(host_artifacts), "--prompts",
                        str(bad)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and 'bad.jsonl:1: "messages" must be a non-empty list' in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    ok = tmp_path / "chat.jsonl"
    ok.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    no_template = chat_target(tmp_path / "plain", target_dir)
    (no_template / "tokenizer_config.json").write_text("{}")
    r = subprocess.run([sys.executable, "-m", "dflash_iree", "bench", "--artifacts", str(host_artifacts), "--target",
                        str(no_template), "--prompts", str(ok)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "tokenizer_config.json has no chat_template" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_draft_step_bench_runs_on_host_artifacts(hybrid_artifacts, tmp_path):
    """bench/draft_step.py (issue 27's draft step against verify) on the tiny hybrid pair, host CPU."""
    out = tmp_path / "draft_step.json"
    r = subprocess.run([sys.executable, "bench/draft_step.py", "run", "--artifacts", str(hybrid_artifacts), "--json",
                        str(out), "--device", "cpu", "--prompt-len", "40", "--rounds", "1", "--n", "3"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    a = json.loads(out.read_text())["artifacts"][hybrid_artifacts.name]
    assert a["draft"]["n"] == a["verify"]["n"] == 3 and a["draft_over_verify"] > 0
    r = subprocess.run([sys.executable, "bench/draft_step.py", "report", str(out)], capture_output=True, text=True)
    assert r.returncode == 0 and "| draft / verify |" in r.stdout
