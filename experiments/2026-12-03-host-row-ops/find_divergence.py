"""As it ran: which demo prompts part (drafted vs plain vs exact) on the host build at /tmp/rowinv/after (the flag,
before as_float32); wrote /tmp/div<i>.json per parting prompt. Found 5, 12, 13, 14, 15 (plain != exact, drafted == exact)."""
import json
from dflash_iree.runtime.bench import read_prompts
from dflash_iree.runtime.engine import Engine
from dflash_iree.runtime.options import GenerateOptions as G
e = Engine.load("/tmp/rowinv/after", "models/demo/target", "models/demo/drafter")
ps = [e.encode_prompt(p) for p in read_prompts("bench/prompts/code.jsonl", 16)]
for i, p in enumerate(ps):
    d = e.generate(p, options=G(max_new_tokens=128)).tokens
    pl = e.generate(p, options=G(max_new_tokens=128, speculative=False)).tokens
    ex = e.generate(p, options=G(max_new_tokens=128, exact=True)).tokens
    if d != pl or d != ex:
        k = next((j for j, (a, b) in enumerate(zip(d, pl)) if a != b), None)
        print(i, "len", len(p), "drafted==exact", d == ex, "plain==exact", pl == ex, "first div", k, d[k] if k is not None else None, pl[k] if k is not None else None, flush=True)
        json.dump({"prompt": p, "drafted": d, "plain": pl, "exact": ex}, open(f"/tmp/div{i}.json", "w"))
