#!/usr/bin/env python3
"""Writes examples/larger_than_gpu/config.textproto at a fraction of its size.

    python3 examples/larger_than_gpu/scale.py 0.25 > ltg-quarter.textproto

FACTOR in [0.1, 1] scales the experts per MoE layer (40 at 1, 4 at 0.1), the host budget
(32 GiB at 1) and the experts' share of the device budget (14 GiB at 1, beside 2 GiB for the
dense state), so the expert state keeps its ratio to the budgets: 80.0 GiB at 1, 20.0 GiB at
0.25. The data path becomes absolute, so the scaled config may be written anywhere; the model's
shape, the batch and the rest stay as they are. Standard library only.
"""

import os
import re
import sys

EXPERTS = 40
GIB = 1 << 30
DENSE_BYTES = 2 * GIB  # the dense state with its gradients and Adam moments, rounded up
DEVICE_EXPERT_BYTES = 14 * GIB
HOST_BYTES = 32 * GIB


def scaled(text, factor, config_dir):
    """The config `text` (read from `config_dir`) at `factor`."""
    experts = round(EXPERTS * factor)
    device = DENSE_BYTES + int(DEVICE_EXPERT_BYTES * factor)
    host = int(HOST_BYTES * factor)
    replacements = [
        (r'name: "larger_than_gpu"', 'name: "larger_than_gpu_x%g"' % factor),
        (r"num_experts: \d+", "num_experts: %d" % experts),
        (r"device_budget_bytes: \d+ *#[^\n]*", "device_budget_bytes: %d" % device),
        (r"host_budget_bytes: \d+ *#[^\n]*", "host_budget_bytes: %d" % host),
    ]
    for pattern, new in replacements:
        text, n = re.subn(pattern, new, text, count=1)
        if n != 1:
            raise ValueError("config has no '%s' to scale" % pattern)
    data = re.search(r'path: "([^"]+)"[^\n]*', text)
    if data is None:
        raise ValueError("config has no data.path")
    absolute = os.path.normpath(os.path.join(config_dir, data.group(1)))
    text = text.replace(data.group(0), 'path: "%s"' % absolute, 1)
    header = "# larger_than_gpu at scale %g (examples/larger_than_gpu/scale.py)\n" % factor
    return header + text


def main(argv):
    if len(argv) != 2:
        sys.stderr.write("usage: scale.py FACTOR > config.textproto  (FACTOR in [0.1, 1])\n")
        return 2
    try:
        factor = float(argv[1])
    except ValueError:
        factor = float("nan")
    if not 0.1 <= factor <= 1:
        sys.stderr.write("scale.py: FACTOR must be a number in [0.1, 1], not '%s'\n" % argv[1])
        return 2
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "config.textproto")) as f:
        text = f.read()
    sys.stdout.write(scaled(text, factor, here))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
