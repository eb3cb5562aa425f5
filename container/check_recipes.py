#!/usr/bin/env python3
"""Checks the Kubernetes and Slurm recipes of a Markdown file against a strata program.

    check_recipes.py DOC.md --image strata:latest --strata 'COMMAND PREFIX THAT RUNS strata'

Every ```yaml block must parse (all its documents) and be a known kind; every container in a
Deployment or Job must name --image and run a strata subcommand whose flags that strata's
`strata SUBCOMMAND --help` lists. The ```sh block holding #SBATCH lines is the Slurm recipe: its
`strata coordinator` and `strata worker` calls are checked the same way. Prints what it checked;
exits 1 with one line per problem.
"""
import argparse
import re
import shlex
import subprocess
import sys

import yaml

KINDS = {("v1", "Service"), ("apps/v1", "Deployment"), ("batch/v1", "Job"), ("v1", "ConfigMap"),
         ("v1", "Secret"), ("v1", "PersistentVolumeClaim")}


def blocks(text, lang):
    return re.findall(r"^```" + lang + r"\n(.*?)^```", text, re.S | re.M)


def strata_calls(words):
    """(subcommand, [flags]) of each strata program in a shell word list."""
    calls = []
    for i, w in enumerate(words):
        if (w == "strata" or w.endswith("/strata")) and i + 1 < len(words):
            flags = []
            for x in words[i + 2:]:
                if x in ("&", "&&", "|", ";", "\\", "\n"):
                    break
                if x.startswith("--"):
                    flags.append(x.split("=", 1)[0])
            calls.append((words[i + 1], flags))
    return calls


def shell_words(script):
    """Words as the shell splits them, with a "\\n" word where a command line ends (line
    continuations join; the script of `bash -c '...'` is split again by expand)."""
    words = []
    for line in script.replace("\\\n", " ").split("\n"):
        words.extend(shlex.split(line, comments=True))
        words.append("\n")
    return words


def expand(words):
    """The words, with the script of each `sh -c` / `bash -c` split again."""
    out = []
    for i, w in enumerate(words):
        out.append(w)
        if w == "-c" and i > 0 and words[i - 1].split("/")[-1] in ("sh", "bash") and i + 1 < len(words):
            out.extend(expand(shell_words(words[i + 1])))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("doc")
    ap.add_argument("--image", required=True)
    ap.add_argument("--strata", required=True, help="command prefix that runs strata")
    a = ap.parse_args()
    text = open(a.doc, encoding="utf-8").read()
    problems, checked = [], []
    helps = {}

    def check_call(where, sub, flags):
        if sub not in helps:
            r = subprocess.run(shlex.split(a.strata) + [sub, "--help"], capture_output=True,
                               text=True)
            helps[sub] = r.stdout + r.stderr if r.returncode == 0 else None
        if helps[sub] is None:
            problems.append(f"{where}: `strata {sub} --help` failed: not a strata subcommand")
            return
        for f in flags:
            if not re.search(r"^\s+" + re.escape(f) + r"(?=[\s=]|$)", helps[sub], re.M):
                problems.append(f"{where}: `strata {sub}` has no flag {f}")
        checked.append(f"{where}: strata {sub} {' '.join(flags)}")

    containers = 0
    for n, block in enumerate(blocks(text, "yaml"), 1):
        try:
            docs = [d for d in yaml.safe_load_all(block) if d is not None]
        except yaml.YAMLError as e:
            problems.append(f"yaml block {n}: does not parse: {e}")
            continue
        for d in docs:
            kind = (d.get("apiVersion"), d.get("kind"))
            name = d.get("metadata", {}).get("name", "?")
            if kind not in KINDS:
                problems.append(f"yaml block {n}: unknown apiVersion/kind {kind} ({name})")
            if d.get("kind") not in ("Deployment", "Job"):
                continue
            for c in d["spec"]["template"]["spec"].get("containers", []):
                containers += 1
                where = f"{d['kind']} {name}, container {c.get('name')}"
                if c.get("image") != a.image:
                    problems.append(f"{where}: image {c.get('image')!r}, not {a.image!r}")
                words = [str(x) for x in c.get("command", []) + c.get("args", [])]
                if "command" in c:
                    problems.append(f"{where}: gives command:, which replaces the image's "
                                    "entrypoint (tini); give args:")
                calls = strata_calls(expand(words))
                if not calls:
                    problems.append(f"{where}: runs no strata subcommand")
                for sub, flags in calls:
                    check_call(where, sub, flags)
    if containers == 0:
        problems.append("no Kubernetes Deployment or Job with containers found")

    slurm = [b for b in blocks(text, "sh") if "#SBATCH" in b]
    if not slurm:
        problems.append("no Slurm recipe (a ```sh block with #SBATCH lines) found")
    for b in slurm:
        calls = strata_calls(expand(shell_words(b)))
        if {s for s, _ in calls} != {"coordinator", "worker"}:
            problems.append(f"Slurm recipe: runs {sorted({s for s, _ in calls})}, not a "
                            "coordinator and workers")
        for sub, flags in calls:
            check_call("Slurm recipe", sub, flags)

    for c in checked:
        print("checked", c)
    for p in problems:
        print("problem:", p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
