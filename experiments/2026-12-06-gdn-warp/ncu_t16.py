"""Three calls of bench/gdn_check.py's T = 16 module in DIR, for Nsight Compute to profile one:
    ncu --kernel-name regex:dflash_gdn --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats python3 experiments/2026-12-06-gdn-warp/ncu_t16.py DIR
"""
import sys

import iree.runtime as rt
import numpy as np

sys.path.insert(0, "bench")
import gdn_check as g  # noqa: E402

device = rt.get_device("cuda")
m = g._Module(rt, device, f"{sys.argv[1]}/gdn_t16.vmfb")
(mixed, b, a, A_log, dt_bias), slots0 = g._inputs(16)
m.fn["set_slots"](slots0)
args = [rt.asdevicearray(device, v) for v in (mixed, b, a, A_log, dt_bias, np.array([[g.FROM, 0]], np.int32))]
for _ in range(3):
    np.asarray(m.fn["gdn"](*args, g.LAYER))
