#!/usr/bin/env python3
"""Builds the default example's corpus: English text from Debian's `fortunes` package.

Reads every fortune database under /usr/share/games/fortunes (skipping the ASCII-art ones),
removes terminal overstrike sequences, shuffles the fortunes with a fixed seed so the held-out
tail is a fair sample of all of them, and writes one UTF-8 file, fortunes separated by blank
lines. Deterministic: the same package version gives the same bytes.

usage: prepare_data.py [--out FILE] [--source DIR]
"""
import argparse
import os
import random
import re
import sys

SKIP = {"art", "ascii-art"}  # pictures, not English text


def read_fortunes(source):
    fortunes = []
    for name in sorted(os.listdir(source)):
        path = os.path.join(source, name)
        if name in SKIP or "." in name or not os.path.isfile(path):
            continue  # .dat indexes and .u8 links are not databases
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
        text = re.sub(r".\x08", "", text)  # overstrike: "_\bx" or "x\bx" -> "x"
        for item in re.split(r"^%\s*$", text, flags=re.M):
            item = item.strip("\n")
            if item.strip():
                fortunes.append(item)
    return fortunes


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(here, "data", "fortunes.txt"))
    ap.add_argument("--source", default="/usr/share/games/fortunes")
    args = ap.parse_args()
    if not os.path.isdir(args.source):
        sys.exit(f"prepare_data.py: {args.source} not found; install the Debian package "
                 "'fortunes' (scripts/install-deps.sh does)")
    fortunes = read_fortunes(args.source)
    if len(fortunes) < 1000:
        sys.exit(f"prepare_data.py: only {len(fortunes)} fortunes under {args.source}; is the "
                 "'fortunes' package complete?")
    random.Random(1234).shuffle(fortunes)
    data = ("\n\n".join(fortunes) + "\n").encode("utf-8")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, args.out)
    print(f"prepare_data.py: {len(fortunes)} fortunes, {len(data)} bytes -> {args.out}")


if __name__ == "__main__":
    main()
