"""Bad requests (issue #22): token ids, sampling settings, counts and text, through the CLI and the
API. Each ends in exit status 2 (DFlashError for the API) with one message naming the option and
the fix, no traceback, and the artifact folder unchanged; the few that are not mistakes end in a
correct result. The files, checkpoints, compiles and Ctrl-C are in test_bad_input_files.py.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from badinput import assert_refused, cli, dflash, snapshot

from dflash_iree.errors import DFlashError
from dflash_iree.runtime.engine import Engine

IDS = "7 300 12"

# (case, extra generate arguments, what the message must name)
GENERATE_REFUSALS = [
    ("id-far-above-vocab", ["--prompt-ids", "7 99999999999"], ["prompt token id 99999999999", "0..511"]),
    ("id-equal-to-vocab", ["--prompt-ids", "512"], ["prompt token id 512 (position 0)", "vocab_size 512"]),
    ("id-just-above-vocab", ["--prompt-ids", "1,513"], ["prompt token id 513 (position 1)"]),
    ("id-negative", ["--prompt-ids", "4 -1"], ["prompt token id -1"]),
    ("ids-not-integers", ["--prompt-ids", "1 2.5"], ["--prompt-ids '1 2.5' is not a list of integers"]),
    ("ids-empty", ["--prompt-ids", " "], ["the prompt is empty"]),
    ("temperature-nan", ["--prompt-ids", IDS, "--temperature", "nan"], ["temperature nan is not a finite number"]),
    ("temperature-inf", ["--prompt-ids", IDS, "--temperature", "inf"], ["temperature inf is not a finite number"]),
    ("temperature-negative", ["--prompt-ids", IDS, "--temperature", "-0.5"], ["temperature -0.5 is out of range"]),
    ("temperature-underflows", ["--prompt-ids", IDS, "--temperature", "1e-30"], ["temperature 1e-30 is out of range"]),
    ("top-p-zero", ["--prompt-ids", IDS, "--top-p", "0"], ["top_p 0.0 is out of range", "(0, 1]"]),
    ("top-p-above-one", ["--prompt-ids", IDS, "--top-p", "1.5"], ["top_p 1.5 is out of range"]),
    ("top-p-nan", ["--prompt-ids", IDS, "--top-p", "nan"], ["top_p nan is not a finite number"]),
    ("top-k-negative", ["--prompt-ids", IDS, "--top-k", "-1"], ["top_k -1 is out of range"]),
    ("seed-above-64-bits", ["--prompt-ids", IDS, "--seed", str(2**64 + 5)], ["seed 18446744073709551621", "0..4294967295"]),
    ("seed-above-32-bits", ["--prompt-ids", IDS, "--seed", str(2**32)], ["seed 4294967296 is out of range", "low 32 bits"]),
    ("seed-negative", ["--prompt-ids", IDS, "--seed", "-1"], ["seed -1 is out of range"]),
    ("max-new-tokens-zero", ["--prompt-ids", IDS, "--max-new-tokens", "0"], ["max_new_tokens 0 is out of range"]),
    ("max-new-tokens-negative", ["--prompt-ids", IDS, "--max-new-tokens", "-3"], ["max_new_tokens -3 is out of range"]),
    ("num-speculative-zero", ["--prompt-ids", IDS, "--num-speculative-tokens", "0"],
     ["num_speculative_tokens 0 is out of range: use 1..7"]),
    ("num-speculative-over", ["--prompt-ids", IDS, "--num-speculative-tokens", "8"],
     ["num_speculative_tokens 8 is out of range"]),
    ("draft-top-k-negative", ["--prompt-ids", IDS, "--draft-top-k", "-1"], ["draft_top_k -1 is out of range"]),
    ("prompt-and-prompt-ids", ["--prompt", "x", "--prompt-ids", IDS], ["--prompt-ids is a prompt of its own"]),
    ("encoding-unknown", ["--prompt", "x", "--encoding", "klingon"], ["--encoding klingon: unknown encoding"]),
    ("request-over-max-context", ["--prompt-ids", " ".join(["1"] * 250)], ["exceeds max_context 256"]),
    ("text-without-tokenizer", ["--prompt", "hello"], ["tokenizer.json does not exist", "--prompt-ids"]),
]


@pytest.mark.parametrize("argv,needles", [c[1:] for c in GENERATE_REFUSALS], ids=[c[0] for c in GENERATE_REFUSALS])
def test_generate_refuses(capsys, host_artifacts, argv, needles):
    before = snapshot(host_artifacts)
    rc, out, err = cli(capsys, "generate", "--artifacts", host_artifacts, *argv)
    assert_refused(rc, err, *needles)
    assert out == "" and snapshot(host_artifacts) == before


def test_id_far_above_the_vocabulary_does_not_crash(host_artifacts):
    """The segfault of the issue (an out-of-bounds gather on the device), in a real process."""
    r = dflash("generate", "--artifacts", host_artifacts, "--prompt-ids", "5 " + str(2**40), "--max-new-tokens", "4")
    assert_refused(r.returncode, r.stderr, f"prompt token id {2**40} (position 1)")


def test_eager_refuses_bad_ids_and_sampling(capsys, target_dir):
    for argv, needle in ([["--prompt-ids", "600"], "prompt token id 600"],
                         [["--prompt-ids", "1", "--temperature", "nan"], "temperature nan"],
                         [["--prompt-ids", "1", "--seed", str(2**70)], "seed 1180591620717411303424"],
                         [["--prompt-ids", "1", "--max-context", "4096"],
                          "--max-context 4096 is out of range: use 2..1024 (the target's max_position_embeddings"],
                         [["--prompt-ids", "1", "--max-new-tokens", "1500"], "exceeds max_context 1024"]):
        rc, _, err = cli(capsys, "eager", "--target", target_dir, *argv)
        assert_refused(rc, err, needle)


@pytest.fixture(scope="module")
def engine(host_artifacts):
    return Engine.load(host_artifacts)


class BadProposer:
    """A stand-in drafter proposing an id outside the vocabulary."""

    def begin(self, taps):
        pass

    def propose(self, tokens, new_taps, ctx_start):
        return [600] * 7


# (case, prompt, generate keywords, message pattern): the API refuses before the device is used
API_REFUSALS = [
    ("id-far-above", [10**12], {}, r"prompt token id 1000000000000 \(position 0\)"),
    ("id-bool", [True, 3], {}, r"prompt token 0 is True, not an integer"),
    ("id-float", [1.5], {}, r"prompt token 0 is 1.5, not an integer"),
    ("id-numpy-over", np.array([3, 512]), {}, r"prompt token id 512 \(position 1\)"),
    ("prompt-bytes", b"hello", {}, r"the prompt is bytes; decode it"),
    ("prompt-none", None, {}, r"the prompt is a NoneType"),
    ("stop-id-over", [1], {"stop": [512]}, r"stop token id 512"),
    ("stop-id-negative", [1], {"stop": -3}, r"stop token id -3"),
    ("stop-float", [1], {"stop": [1.5]}, r"stop item 1.5 is neither"),
    ("temperature-nan", [1], {"temperature": math.nan}, r"temperature nan is not a finite number"),
    ("temperature-str", [1], {"temperature": "0.7"}, r"temperature '0.7' is not a number"),
    ("top-k-float", [1], {"top_k": 2.5, "temperature": 1.0}, r"top_k 2.5 is not an integer"),
    ("seed-64-bits", [1], {"seed": 2**64}, r"seed 18446744073709551616 is out of range"),
    ("seed-float", [1], {"seed": 1.5}, r"seed 1.5 is not an integer"),
    ("max-new-tokens-float", [1], {"max_new_tokens": 2.5}, r"max_new_tokens 2.5 is not an integer"),
    ("num-speculative-float", [1], {"num_speculative_tokens": 2.5}, r"num_speculative_tokens 2.5 is not an integer"),
    ("proposer-id-over", [1], {"proposer": BadProposer()}, r"proposer draft token id 600"),
]


@pytest.mark.parametrize("prompt,kw,match", [c[1:] for c in API_REFUSALS], ids=[c[0] for c in API_REFUSALS])
def test_api_refuses(engine, prompt, kw, match):
    kw = {"max_new_tokens": 6, **kw}
    seams = {"proposer": kw.pop("proposer")} if "proposer" in kw else {}  # a test seam, not an option
    with pytest.raises(DFlashError, match=match):
        engine.with_seams(**seams).generate(prompt, **kw)
    assert engine.generate([7, 300, 12], 6).tokens == engine.generate([7, 300, 12], 6, speculative=False).tokens


def test_api_values_that_are_not_mistakes(engine):
    """numpy ids, a top_k above the vocabulary (every token kept, as with 0) and the largest
    seed give correct results."""
    want = engine.generate([7, 300, 12], 10).tokens
    assert engine.generate(np.array([7, 300, 12], np.int64), 10).tokens == want
    s = dict(temperature=1.0, seed=3)
    assert engine.generate([7, 300, 12], 10, top_k=2**70, **s).tokens == engine.generate([7, 300, 12], 10, **s).tokens
    top = engine.generate([7, 300, 12], 10, temperature=1.0, seed=2**32 - 1)
    assert top.tokens == engine.generate([7, 300, 12], 10, temperature=1.0, seed=2**32 - 1, speculative=False).tokens


def _prompts(tmp_path, rows) -> str:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("argv,needles", [
    (["--runs", "0"], ["--runs 0 is out of range: use 1 or more"]),
    (["--runs", "-1"], ["--runs -1 is out of range"]),
    (["--limit", "0"], ["--limit 0 is out of range: use 1 or more"]),
    (["--limit", "-2"], ["--limit -2 is out of range"]),
    (["--json", "/nonexistent-folder/b.json"], ["--json /nonexistent-folder/b.json: the folder /nonexistent-folder"]),
], ids=["runs-0", "runs-negative", "limit-0", "limit-negative", "json-folder-missing"])
def test_bench_refuses(capsys, host_artifacts, tmp_path, argv, needles):
    prompts = _prompts(tmp_path, [{"prompt_ids": [7, 300, 12]}])
    before = snapshot(host_artifacts), snapshot(tmp_path)
    rc, out, err = cli(capsys, "bench", "--artifacts", host_artifacts, "--prompts", prompts, "--max-new-tokens", "4",
                       *argv)
    assert_refused(rc, err, *needles)
    assert out == "" and (snapshot(host_artifacts), snapshot(tmp_path)) == before


def test_bench_plot_without_matplotlib_refused_before_the_run(capsys, host_artifacts, tmp_path):
    try:
        import matplotlib  # noqa: F401
        pytest.skip("matplotlib is installed")
    except ImportError:
        pass
    out = tmp_path / "b.json"
    rc, stdout, err = cli(capsys, "bench", "--artifacts", host_artifacts, "--prompts",
                          _prompts(tmp_path, [{"prompt_ids": [7, 300, 12]}]), "--json", out, "--plot", tmp_path / "b.png")
    assert_refused(rc, err, "--plot needs matplotlib")
    assert stdout == "" and not out.exists()


def test_prompt_file_that_is_not_utf8(capsys, host_artifacts, tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    rc, _, err = cli(capsys, "bench", "--artifacts", host_artifacts, "--prompts", bad)
    assert_refused(rc, err, f"{bad} is not valid utf-8: byte 0xe9 at offset 15 (line 1)", "--encoding")
    rc, _, err = cli(capsys, "bench", "--artifacts", host_artifacts, "--prompts", bad, "--encoding", "latin-1")
    assert_refused(rc, err, "tokenizer.json does not exist")  # read as text; the tiny target has no tokenizer


@pytest.mark.parametrize("row,needle", [
    ({"prompt": 5}, ":1: \"prompt\" must be a string"),
    ({"prompt_ids": [1, "2"]}, ":1: \"prompt\" must be a string, \"prompt_ids\" a non-empty list"),
    ({"prompt": "\udcff"}, ":1 \"prompt\" is not valid text"),
], ids=["prompt-number", "ids-with-string", "lone-surrogate"])
def test_prompt_file_rows_refused(capsys, host_artifacts, tmp_path, row, needle):
    prompts = _prompts(tmp_path, [row])
    before = snapshot(host_artifacts), snapshot(tmp_path)
    rc, _, err = cli(capsys, "bench", "--artifacts", host_artifacts, "--prompts", prompts)
    assert_refused(rc, err, needle)
    assert (snapshot(host_artifacts), snapshot(tmp_path)) == before


def test_demo_index_out_of_range(capsys, host_artifacts, tmp_path):
    rc, _, err = cli(capsys, "demo", "--artifacts", host_artifacts, "--prompts",
                     _prompts(tmp_path, [{"prompt_ids": [1, 2]}]), "--index", "3")
    assert_refused(rc, err, "--index 3 is out of range: use 0..0")


def test_non_utf8_prompt_on_the_command_line(host_artifacts):
    """argv holds bytes; one not valid UTF-8 is refused by offset, before the engine loads."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable.encode(), b"-m", b"dflash_iree", b"generate", b"--artifacts",
                        bytes(host_artifacts), b"--prompt", b"caf\xe9"], capture_output=True, timeout=300)
    err = r.stderr.decode()
    assert_refused(r.returncode, err, "--prompt is not valid utf-8: byte 0xe9 at offset 3", "--encoding")


def test_bench_never_writes_over_its_prompts_or_a_users_file(capsys, host_artifacts, tmp_path):
    prompts = _prompts(tmp_path, [{"prompt_ids": [7, 300, 12]}])
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    before = snapshot(tmp_path)
    for target, needle in ((prompts, "is the --prompts file"), (notes, "exists and is not an earlier bench result")):
        rc, out, err = cli(capsys, "bench", "--artifacts", host_artifacts, "--prompts", prompts, "--max-new-tokens",
                           "4", "--json", target)
        assert_refused(rc, err, f"--json {target}", needle)
        assert out == ""
    assert snapshot(tmp_path) == before
    result = tmp_path / "result.json"  # an earlier result of bench itself is replaced
    for _ in range(2):
        rc, _, err = cli(capsys, "bench", "--artifacts", host_artifacts, "--prompts", prompts, "--max-new-tokens", "4",
                         "--json", result, "--quiet")
        assert rc == 0, err
    assert json.loads(result.read_text())["same_tokens"] is True


def test_exact_is_plain_decoding_even_without_no_draft(capsys, engine, host_artifacts):
    """exact=True means plain decoding through the verify graph: no rounds, however speculative is set."""
    out = engine.generate([7, 300, 12], 12, exact=True)
    assert out.accepted == [] and out.block_size == 1
    assert out.tokens == engine.generate([7, 300, 12], 12).tokens
    rc, stdout, err = cli(capsys, "generate", "--artifacts", host_artifacts, "--prompt-ids", IDS, "--max-new-tokens",
                          "6", "--exact", "--json")
    assert rc == 0 and json.loads(stdout)["stats"]["accepted"] == [], err


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--max-new-tokens", "abc"], "argument --max-new-tokens: invalid int value: 'abc'"),
    (["compile", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    ([], "the following arguments are required: command"),
])
def test_argument_errors_are_one_line(capsys, argv, needle):
    rc, out, err = cli(capsys, *argv)
    assert rc == 2 and needle in err and "see dflash-iree" in err and "--help" in err
    assert len(err.strip().splitlines()) == 1, err


def test_version(capsys):
    rc, out, _ = cli(capsys, "--version")
    assert rc == 0 and out.startswith("dflash-iree ")


def test_options_of_the_wrong_type(engine):
    with pytest.raises(DFlashError, match=r"^speculative 'no' is not True or False"):
        engine.generate([7, 300, 12], 4, speculative="no")
    with pytest.raises(TypeError, match=r"options is a dict; pass a GenerateOptions"):
        engine.generate([7, 300, 12], 4, options={"temperature": 1.0})


def test_bench_checks_every_prompt_fits_before_running(capsys, host_artifacts, tmp_path):
    prompts = _prompts(tmp_path, [{"prompt_ids": [7, 300, 12]}, {"prompt_ids": [5] * 300}])
    rc, out, err = cli(capsys, "bench", "--artifacts", host_artifacts, "--prompts", prompts, "--max-new-tokens", "4")
    assert_refused(rc, err, "prompt 2 of 2: prompt (300 tokens)", "exceeds max_context 256")
    assert out == "" and "run 1/1" not in err
    rc, _, err = cli(capsys, "bench", "--artifacts", host_artifacts, "--prompts", tmp_path)
    assert_refused(rc, err, f"{tmp_path} is a folder; pass a JSONL file")


@pytest.mark.parametrize("prompt,kw,match", [
    ({"role": "user", "content": "hi"}, {}, r"the prompt is one chat message \(a dict\)"),
    ([1], {"stop": 1.5}, r"stop 1\.5 is neither a stop string"),
    ([1], {"stop": b"\n"}, r"stop b'\\n' is neither"),
    ([1], {"stop": {"a": 1}}, r"stop \{'a': 1\} is neither"),
    ([1], {"temperature": 10**400}, r"temperature 1000.* is not a finite number"),
], ids=["one-message-dict", "stop-float", "stop-bytes", "stop-dict", "temperature-huge-int"])
def test_api_refuses_more(engine, prompt, kw, match):
    with pytest.raises(DFlashError, match=match):
        engine.generate(prompt, 4, **kw)


def test_exact_as_an_option_can_be_replaced(engine):
    """exact is not written into speculative: a later exact=False drafts again."""
    from dflash_iree.runtime.options import GenerateOptions

    o = GenerateOptions(exact=True)
    assert o.speculative and not o.drafted
    assert engine.generate([7, 300, 12], 12, options=o, exact=False).accepted != []
    with pytest.raises(DFlashError, match=r"or exact=True \(--exact\) nothing is drafted"):
        engine.generate([7, 300, 12], 4, exact=True, draft_top_k=2)

