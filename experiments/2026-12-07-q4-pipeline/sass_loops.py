"""Loops of a SASS listing (cuobjdump -sass, addresses kept): each backward branch's body, its instruction count by
opcode and per HMMA.  python3 sass_loops.py file.sass"""
import re, sys, collections
lines = [l for l in open(sys.argv[1]) if re.search(r'/\*[0-9a-f]{4}\*/', l)]
ins = []
for l in lines:
    m = re.search(r'/\*([0-9a-f]+)\*/\s+(.*?);', l)
    ins.append((int(m.group(1), 16), m.group(2).strip()))
addr = {a: i for i, (a, _) in enumerate(ins)}
# backward branches: loops
loops = []
for i, (a, t) in enumerate(ins):
    m = re.search(r'BRA (?:`\(\.L_x_\d+\)|0x([0-9a-f]+))', t)
    m2 = re.search(r'BRA\s+(0x[0-9a-f]+)', t)
    if m2:
        tgt = int(m2.group(1), 16)
        if tgt <= a and tgt in addr:
            j = addr[tgt]
            body = ins[j:i + 1]
            h = sum('HMMA' in x for _, x in body)
            loops.append((h, j, i))
print("total", len(ins), "HMMA", sum('HMMA' in t for _, t in ins))
for h, j, i in sorted(loops, reverse=True)[:3]:
    body = [t for _, t in ins[j:i + 1]]
    c = collections.Counter(re.sub(r'^@!?U?P\w+\s+', '', t).split()[0].split('.')[0] for t in body)
    print(f"loop {ins[j][0]:#x}-{ins[i][0]:#x}: {len(body)} instrs, HMMA {h}, per HMMA {len(body)/max(h,1):.1f}:", dict(c.most_common(14)))
