#!/bin/bash
# Two mutable globals of one type, updated in place: write b's first half, then a's second; read b.
# Run from the repository root: bash experiments/2026-12-05-global-aliasing/probe.sh
set -euo pipefail
here=experiments/2026-12-05-global-aliasing
for f in equal_splats plus_minus_zero; do
  .venv/bin/iree-compile $here/$f.mlir --iree-hal-target-device=local --iree-hal-local-target-device-backends=llvm-cpu \
      --iree-llvmcpu-target-cpu=host -o /tmp/$f.vmfb
  .venv/bin/python -c "
import iree.runtime as rt, numpy as np
cfg = rt.Config('local-task'); ctx = rt.SystemContext(config=cfg)
ctx.add_vm_module(rt.VmModule.mmap(cfg.vm_instance, '/tmp/$f.vmfb')); m = ctx.modules.m
m.write_b(np.full(4, 5, np.float32), 0); m.write_a(np.arange(1, 5, dtype=np.float32), 4)
print('$f: a', m.read_a().to_host(), 'b', m.read_b().to_host())"
done
