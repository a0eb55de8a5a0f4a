"""`dflash-iree compile` on tiny configs: the manifest, host parity against the eager
reference, no whole-cache copies in a decode step, and the per-arch records.

The pair is exported once per session (through the export cache, in a session temp folder), and
every compile below lowers that one export. Records: `make records` rewrites compiled/records/
from this file (DFLASH_IREE_UPDATE_RECORDS=1).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_iree.acceptance import accept_length
from dflash_iree.checkpoint import sha256_file
from dflash_iree.cli import main
from dflash_iree.export import compile as cc
from dflash_iree.export.aot import KV_PAGE
from dflash_iree.export.load import load_pair
from dflash_iree.export.sampling import Sampling
from dflash_iree.kernels.topk.reference import score
from dflash_iree.manifest import DTYPES, Manifest, numpy_dtype

RECORDS = Path(__file__).resolve().parents[1] / "compiled" / "records"
UPDATE_RECORDS = os.environ.get("DFLASH_IREE_UPDATE_RECORDS") == "1"
CONTEXT = 256  # tiny max_context


@pytest.fixture(scope="session")
def export_cache(tmp_path_factory):
    """A session-private export cache, so the CLI run below reuses the session's one export."""
    old = os.environ.get("DFLASH_IREE_CACHE")
    os.environ["DFLASH_IREE_CACHE"] = str(tmp_path_factory.mktemp("export-cache"))
    yield Path(os.environ["DFLASH_IREE_CACHE"])
    if old is None:
        os.environ.pop("DFLASH_IREE_CACHE")
    else:
        os.environ["DFLASH_IREE_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_export(export_cache, target_dir, drafter_dir, tmp_path_factory):
    """(plan, MLIR path) of the tiny pair: block 8, max_context 256, float32."""
    p = cc.plan(target_dir, drafter_dir, max_context=CONTEXT)
    mlir = cc.export_cached(p, tmp_path_factory.mktemp("work"), log=lambda m: None)
    return p, mlir


@pytest.fixture(scope="session")
def tiny_export_cpu(export_cache, target_dir, drafter_dir, tmp_path_factory):
    """The same with the CPU's attention form (Arch.attention of host: "matmul")."""
    p = cc.plan(target_dir, drafter_dir, max_context=CONTEXT, attention=cc.ARCHS["host"].attention)
    mlir = cc.export_cached(p, tmp_path_factory.mktemp("work"), log=lambda m: None)
    return p, mlir


@pytest.fixture(scope="session")
def host_cli(tiny_export_cpu, target_dir, drafter_dir, tmp_path_factory):
    """`dflash-iree compile --arch host` on the tiny pair (the export comes from the cache)."""
    out = tmp_path_factory.mktemp("cli") / "host"
    rc = main(["compile", "--arch", "host", "--target", str(target_dir), "--drafter", str(drafter_dir),
               "--out", str(out), "--max-context", str(CONTEXT)])
    assert rc == 0
    return out


@pytest.fixture(scope="session")
def records_built(tiny_export, tiny_export_cpu, tmp_path_factory):
    """Every ARCH lowered from the export of its attention form, two at a time; host for the fixed
    record CPU, with its compilation phases dumped (the HAL IR for the copy test).
    arch -> (folder, phases folder)."""
    root = tmp_path_factory.mktemp("records")

    def build(arch):
        p, mlir = tiny_export_cpu if cc.ARCHS[arch].attention == "matmul" else tiny_export
        phases = root / f"{arch}-phases" if arch == "host" else None
        cc.lower(p, arch, mlir, root / arch, log=lambda m: None, record=True, dump_phases=phases)
        return arch, (root / arch, phases)

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(build, list(cc.ARCHS)))


# ---------------------------------------------------------------- the CLI's artifact


def test_cli_writes_module_and_manifest(host_cli, capsys):
    assert sorted(p.name for p in host_cli.iterdir()) == ["dflash.vmfb", "manifest.json"]
    assert not [p for p in host_cli.parent.iterdir() if p.name.startswith(".")]  # no stage folder left


def test_manifest(host_cli, target_dir, drafter_dir):
    m = json.loads((host_cli / "manifest.json").read_text())
    assert m["format_version"] == cc.FORMAT_VERSION and m["arch"] == "host" and m["driver"] == "local-task"
    assert m["versions"]["iree_base_compiler"] == "3.13.0" and m["versions"]["torch"].startswith("2.13")
    assert "--iree-llvmcpu-target-cpu=host" in m["flags"]
    assert m["target"]["folder"] == str(Path(target_dir).resolve())
    assert m["drafter"]["folder"] == str(Path(drafter_dir).resolve())
    for scope, folder in (("target", target_dir), ("drafter", drafter_dir)):  # found again when moved together
        assert not Path(m[scope]["folder_relative"]).is_absolute()
        assert (host_cli / m[scope]["folder_relative"]).resolve() == Path(folder).resolve()
    assert len(m["target"]["config_hash"]) == 64 and m["drafter"]["raw_config"]["block_size"] == 8
    assert (m["block_size"], m["max_context"], m["dtype"], m["streams"]) == (8, CONTEXT, "f32", 1)
    names = [e["name"] for e in m["entry_points"]]
    assert names == ["prefill", "verify", "decode", "verify_draft", "prefill_sampled", "verify_sampled",
                     "decode_sampled", "verify_draft_sampled", "absorb", "draft", "draft_topk", "draft_sampled",
                     "draft_topk_sampled"]
    e = {x["name"]: x for x in m["entry_points"]}
    assert e["verify"]["args"][0] == {"name": "tokens", "shape": [1, 8], "dtype": "i64"}
    assert e["verify"]["results"] == [{"name": "taps", "shape": [1, 8, 128], "dtype": "f32"}]
    assert e["verify"]["writes"] == ["chosen"] and e["verify"]["args"][-1] == {"name": "chosen", "shape": [1, 8], "dtype": "i64"}
    assert e["decode"]["results"] == [] and e["decode"]["writes"] == ["chosen"]
    assert e["prefill"]["args"][0]["shape"] == [1, "T"] and e["absorb"]["args"][0]["shape"] == [1, "R", 128]
    assert e["draft"]["results"] == [] and e["draft"]["args"][-1] == {"name": "draft", "shape": [1, 7], "dtype": "i64"}
    assert e["verify_draft"]["args"][2] == {"name": "n_draft", "shape": [1], "dtype": "i64"}
    assert e["verify_draft"]["results"] == [{"name": "taps", "shape": [1, 8, 128], "dtype": "f32"}]
    assert e["verify_draft"]["args"][-1] == {"name": "round", "shape": [1, 16], "dtype": "i64"}
    # draft_topk: K fixed at compile time (default 8), recorded; the greedy draft entry unchanged
    assert m["draft_top_k"] == cc.DEFAULT_DRAFT_TOP_K == 8 and m["shapes"]["draft_top_k"] == 8
    assert e["draft_topk"]["args"] == e["draft"]["args"][:-1] + [
        {"name": "temperature", "shape": [1], "dtype": "f32"}, {"name": "draft", "shape": [1, 7], "dtype": "i64"},
        {"name": "topk_ids", "shape": [1, 7, 8], "dtype": "i32"}, {"name": "topk_logprobs", "shape": [1, 7, 8], "dtype": "f32"}]
    assert e["draft_topk"]["results"] == [] and e["draft_topk"]["writes"] == ["draft", "topk_ids", "topk_logprobs"]
    assert any("object-search-path" in f for f in m["splice_flags"])
    assert m["stats"]["dispatches_per_call"]["draft_topk"] == m["stats"]["dispatches_per_call"]["draft"] + 2
    # no entry point returns or writes anything vocab-sized
    vocab = m["target"]["config"]["vocab_size"]
    assert all(vocab not in r["shape"] for x in m["entry_points"] for r in x["results"] + x["args"])
    assert m["shapes"]["dims"]["P"] == {"min": 1, "max": CONTEXT // KV_PAGE, "doc": m["shapes"]["dims"]["P"]["doc"]}
    # parameters: the safetensors keys, with shapes and dtypes, per scope; caches are not among them
    from safetensors import safe_open
    for scope, folder in (("target", target_dir), ("drafter", drafter_dir)):
        with safe_open(str(Path(folder) / "model.safetensors"), "np") as f:
            on_disk = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        want = {k: v["shape"] for k, v in m["parameters"][scope].items()}
        assert want == {k: on_disk[k] for k in want}
        assert all(v["dtype"] == "f32" for v in m["parameters"][scope].values())
    assert set(m["parameters"]["drafter"]) == set(on_disk)  # every drafter tensor is bound
    assert m["state"]["globals"]["target.kv_cache"]["shape"] == [1, 4, 2, CONTEXT, 32]
    assert sha256_file(host_cli / "dflash.vmfb") == m["files"]["dflash.vmfb"]
    typed = Manifest.load(host_cli / "manifest.json")  # the typed manifest writes the same JSON back
    assert typed.to_json() == m and list(typed.to_json()) == list(m) and typed.driver == "local-task"


def test_cli_progress_and_summary(host_cli, target_dir, drafter_dir, tmp_path, capsys):
    """Progress lines with elapsed seconds, a one-line summary; an earlier artifact folder is replaced."""
    out = tmp_path / "again"
    shutil.copytree(host_cli, out)
    (out / "dflash.vmfb").write_bytes(b"stale")
    assert main(["compile", "--arch", "host", "--target", str(target_dir), "--drafter", str(drafter_dir),
                 "--out", str(out), "--max-context", str(CONTEXT)]) == 0
    assert (out / "dflash.vmfb").read_bytes() == (host_cli / "dflash.vmfb").read_bytes()
    lines = capsys.readouterr().out.strip().splitlines()
    assert all(re.match(r"\[ *\d+\.\ds\] ", line) for line in lines)
    assert any("export: reusing" in line for line in lines)
    assert any(re.search(r"compile: host done in \d+\.\ds: .* MiB, \d+ executables", line) for line in lines)
    assert re.search(r"done: .*dflash\.vmfb [\d.]+ MiB \+ manifest\.json, \d+ executables; .* total$", lines[-1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]


# ---------------------------------------------------------------- host parity


class Compiled:
    """A thin loader: the vmfb on local-task, the tiny safetensors bound under scopes target / drafter."""

    def __init__(self, folder: Path, target_dir: Path, drafter_dir: Path):
        import iree.runtime as rt

        self.rt = rt
        self.instance = rt.VmInstance()
        self.device = rt.get_device("local-task")
        providers = []
        for scope, ckpt in (("target", target_dir), ("drafter", drafter_dir)):
            index = rt.ParameterIndex()
            index.load(str(Path(ckpt) / "model.safetensors"))
            providers.append(index.create_provider(scope=scope))
        self.module = rt.VmModule.mmap(self.instance, str(folder / "dflash.vmfb"))
        self.context = rt.VmContext(self.instance, modules=[
            rt.create_hal_module(self.instance, self.device),
            rt.create_io_parameters_module(self.instance, *providers), self.module])

        self.entries = {e["name"]: e for e in json.loads((folder / "manifest.json").read_text())["entry_points"]}

    def __call__(self, name, *args):
        """The outputs the call writes into buffers of ours (the manifest's `writes`, passed last),
        then its results, as the entry point returned them all before it wrote any (one: itself)."""
        rt = self.rt
        e = self.entries[name]
        outs = [rt.asdevicearray(self.device, np.zeros(a["shape"], numpy_dtype(a["dtype"])))
                for a in e["args"] if a["name"] in e["writes"]]
        fn = rt.FunctionInvoker(self.context, self.device, self.module.lookup_function(name))
        results = fn(*[a.numpy() if isinstance(a, torch.Tensor) else a for a in args], *outs)
        results = [] if results is None else list(results) if isinstance(results, tuple) else [results]
        values = [o.to_host() for o in outs] + results
        return values[0] if len(values) == 1 else tuple(values)


def _pages(rows: int) -> np.ndarray:
    return np.zeros(-(-rows // KV_PAGE), np.int8)


def _host(x) -> torch.Tensor:
    return torch.from_numpy(np.asarray(x.to_host() if hasattr(x, "to_host") else x).copy())


def _close(got, want, what):
    got = _host(got)
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * max(1.0, want.abs().max().item()), f"{what}: max abs error {err:.3g}"


def test_host_parity_with_eager(host_cli, target_dir, drafter_dir):
    """Prefill, absorb, draft, verify (with rollback), decode and the sampled variants, step by step
    against the eager modules on the same call sequence: equal tokens, taps within tolerance."""
    target, drafter = load_pair(target_dir, drafter_dir, max_context=CONTEXT)
    mod = Compiled(host_cli, target_dir, drafter_dir)
    B = drafter.block_size
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 500, (1, 37), generator=g)
    P = prompt.shape[1]
    zero = torch.zeros(1, dtype=torch.int64)
    with torch.no_grad():
        chosen, _, taps = target(prompt, zero, read_len=P, last_only=True)
        got_chosen, got_taps = mod("prefill", prompt, zero, _pages(P))
        assert _host(got_chosen).tolist() == chosen.tolist()
        _close(got_taps, taps, "prefill taps")
        drafter.absorb(taps, zero)
        assert _host(mod("absorb", got_taps, zero)).tolist() == [P]

        committed = prompt[0].tolist() + [int(chosen[0, -1])]
        new_taps, dev_taps, ctx_start, n_valid = torch.zeros(1, B, taps.shape[-1]), None, P, 0
        sampling = Sampling(torch.tensor([0.9]), torch.tensor([20]), torch.tensor([0.95]), torch.tensor([7]))
        rounds = 0
        for r in range(4):
            start = len(committed) - 1  # the anchor's position
            anchor = torch.tensor([committed[-1]])
            cs, nv = torch.tensor([ctx_start]), torch.tensor([n_valid])
            want_draft, want_logits = drafter(target, new_taps, cs, nv, anchor, read_len=start + B)
            got_draft = mod("draft", dev_taps if dev_taps is not None else new_taps, cs, nv, anchor, _pages(start))
            assert _host(got_draft).tolist() == want_draft.tolist(), f"round {r}: drafted tokens differ"
            # draft_topk on the same arguments (its absorb rewrites the same context rows): the same
            # draft, and the top-K dispatch's ids and log-probs against the eager drafter's top_k
            T = (1.0, 0.7)[r % 2]
            top = mod("draft_topk", dev_taps if dev_taps is not None else new_taps, cs, nv, anchor, _pages(start),
                      np.array([T], np.float32))
            top_draft, top_ids, top_lps = (_host(t) for t in top)
            assert top_draft.tolist() == want_draft.tolist(), f"round {r}: draft_topk's draft differs from draft"
            assert top_ids.dtype == torch.int32 and top_ids.shape == (1, B - 1, 8)
            assert top_ids[0, :, 0].tolist() == want_draft[0].tolist()
            want_ids, want_lps = drafter.top_k(want_logits, torch.tensor([T]), 8)
            s_ = score(want_logits[0].numpy(), T, top_ids[0].numpy(), top_lps[0].numpy())
            assert s_["id_mismatch"] == 0 and s_["max_lp_err"] <= 1e-4, (r, s_)
            same = top_ids == want_ids  # elsewhere only exact ties may swap (kernels/topk/reference.py)
            assert torch.equal(same, torch.ones_like(same)) or s_["tie_swap"] > 0, r
            assert (top_lps - want_lps).abs().max().item() <= 1e-4
            block = torch.cat([anchor[:, None], want_draft], 1)
            s = sampling if r % 2 else None  # greedy and sampled verify
            chosen, _, taps = target(block, torch.tensor([start]), s, read_len=start + B)
            name = "verify_sampled" if s else "verify"
            got_chosen, dev_taps = mod(name, block, torch.tensor([start]), _pages(start + B), *(s or ()))
            assert _host(got_chosen).tolist() == chosen.tolist(), f"round {r}: {name} tokens differ"
            _close(dev_taps, taps, f"round {r}: {name} taps")
            a = accept_length(want_draft[0].tolist(), chosen[0].tolist())
            committed += want_draft[0, :a].tolist() + [int(chosen[0, a])]
            new_taps, ctx_start, n_valid = taps, start, a + 1
            rounds += 1
        # plain steps after the rounds: rolled back by length onto what verify wrote past the commit
        for s, name in ((None, "decode"), (sampling, "decode_sampled"), (None, "decode")):
            pos = len(committed) - 1
            tok = torch.tensor([[committed[-1]]])
            chosen, _, _ = target(tok, torch.tensor([pos]), s, read_len=pos + 1)
            got = mod(name, tok, torch.tensor([pos]), _pages(pos + 1), *(s or ()))
            assert _host(got).tolist() == chosen.tolist(), f"{name} at {pos}"
            committed.append(int(chosen[0, 0]))
        # a sampled prefill of a new request from position 0 (the caches are reused as they are)
        chosen, _, taps = target(prompt[:, :20], zero, sampling, read_len=20, last_only=True)
        got_chosen, got_taps = mod("prefill_sampled", prompt[:, :20], zero, _pages(20), *sampling)
        assert _host(got_chosen).tolist() == chosen.tolist()
        _close(got_taps, taps, "sampled prefill taps")
    assert rounds == 4


# ---------------------------------------------------------------- no whole-cache copies


def _function_body(ir: str, name: str) -> str:
    start = ir.index(f"util.func public @{name}(")
    end = ir.find("\n  util.func ", start + 1)
    return ir[start:end if end > 0 else len(ir)]


def _copy_lengths(body: str) -> list[int]:
    """Byte lengths of every copy_buffer in a HAL function; all must be constants."""
    consts = {m[1]: int(m[2]) for m in re.finditer(r"(%[\w.]+) = arith\.constant (\d+) : index", body)}
    lengths = []
    for m in re.finditer(r"hal\.command_buffer\.copy_buffer<.*?length\((%[\w.]+)\)", body):
        assert m[1] in consts, f"copy of a dynamic length {m[1]}: {m[0][:200]}"
        lengths.append(consts[m[1]])
    return lengths


def test_decode_copies_no_cache(records_built, tiny_export):
    """In the compiled HAL IR, decode (and verify) copy no buffer anywhere near a cache's size."""
    p, _ = tiny_export
    phases = records_built["host"][1]
    hal = next(phases.glob("*.hal.mlir")).read_text()
    assert "util.global" in hal
    esize = 4  # float32
    caches = {name: int(np.prod(g["shape"])) * esize for name, g in p.state.items()}
    layer_slice = CONTEXT * p.target.kv_dim * esize  # one layer's K (or V) rows: the smallest cache piece
    for fn in ("decode$async", "verify$async", "decode_sampled$async"):
        lengths = _copy_lengths(_function_body(hal, fn))
        assert all(n < layer_slice for n in lengths), (fn, lengths, caches)
        assert sum(lengths) < layer_slice, (fn, lengths)


def test_no_weight_copies_at_load(records_built, tiny_export):
    """IREE hoists constant expressions of parameters into globals computed at load (a transposed
    copy of every weight, once per entry point, before the linear decomposition of export/aot.py).
    Every hoisted global must be smaller than the smallest weight matrix."""
    p, _ = tiny_export
    ir = next(records_built["host"][1].glob("*.global-optimization.mlir")).read_text()
    hoisted = re.findall(r"util\.global private (?:mutable )?@(__hoisted\S*) .*?: tensor<([^>]*)>", ir)
    assert hoisted  # the pattern still matches what the compiler prints
    smallest = min(int(np.prod(v["shape"])) * DTYPES[v["dtype"]].bytes
                   for scope in p.parameters.values() for v in scope.values() if len(v["shape"]) == 2)
    for name, ty in hoisted:
        *dims, dtype = ty.split("x")
        size = int(np.prod([int(d) for d in dims])) * DTYPES[dtype].bytes
        assert size < smallest, f"{name}: tensor<{ty}> ({size} bytes) hoisted into a load-time global"


# ---------------------------------------------------------------- records


def _signature(entry: dict) -> str:
    """`name(arg: dtype[dims], ...) -> (result: dtype[dims], ...)`"""
    def spec(t):
        return f"{t['name']}: {t['dtype']}[{','.join(map(str, t['shape']))}]"
    return f"{entry['name']}({', '.join(map(spec, entry['args']))}) -> ({', '.join(map(spec, entry['results']))})"


def facts(folder: Path) -> dict:
    """What a record holds: entry points and signatures (from the module itself and the manifest),
    parameter keys, executable count and the module's sha256."""
    import iree.runtime as rt

    m = json.loads((folder / "manifest.json").read_text())
    module = rt.VmModule.mmap(rt.VmInstance(), str(folder / "dflash.vmfb"))
    return {
        "arch": m["arch"],
        "flags": m["flags"],
        "compiler": m["versions"]["iree_base_compiler"],
        "functions": sorted(module.function_names),
        "entry_points": [_signature(e) for e in m["entry_points"]],
        "parameters": {scope: sorted(keys) for scope, keys in m["parameters"].items()},
        "executables": m["stats"]["executables"],
        "dispatches": m["stats"]["dispatches"],
        "dispatches_per_call": m["stats"]["dispatches_per_call"],
        "module_sha256": m["files"]["dflash.vmfb"],
    }


@pytest.mark.parametrize("arch", list(cc.ARCHS))
def test_record(records_built, arch):
    got = facts(records_built[arch][0])
    path = RECORDS / f"{arch}.json"
    text = json.dumps(got, indent=1, sort_keys=True) + "\n"
    if UPDATE_RECORDS:
        RECORDS.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"no record {path}; make it with `make records`"
    want = path.read_text()
    if want != text:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), str(path), "this build"))
        pytest.fail(f"{arch}: the compiled facts differ from {path}:\n{diff}\n"
                    "If the change is intended, refresh the records with `make records` and commit them.")
