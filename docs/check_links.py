#!/usr/bin/env python3
"""Checks every relative link of README.md and docs/*.md: the file must exist and, when the link
names an anchor in a Markdown file, a heading of that file must have it (GitHub's slugs).

Usage: docs/check_links.py [FILE.md ...]   (default: README.md docs/*.md, from the repository root)
Prints each broken link as FILE:LINE: target (why); exits 1 if there is one, 0 otherwise.
"""
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r'\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)')


def lines_outside_fences(path):
    fence = False
    with open(path, encoding='utf-8') as f:
        for number, line in enumerate(f, 1):
            if line.lstrip().startswith('```'):
                fence = not fence
                continue
            if not fence:
                yield number, line


def slug(heading):
    # GitHub: lower case, drop everything but letters, digits, spaces, '-' and '_', spaces -> '-'.
    text = re.sub(r'`|\*\*?|\[|\]\([^)]*\)', '', heading.strip()).lower()
    text = re.sub(r'[^\w\- ]', '', text)
    return text.replace(' ', '-')


def anchors(path):
    seen, out = {}, set()
    for _, line in lines_outside_fences(path):
        m = re.match(r'^#{1,6}\s+(.*?)\s*#*\s*$', line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else '%s-%d' % (base, n))
    return out


def check(path):
    broken = []
    for number, line in lines_outside_fences(path):
        for target in LINK.findall(re.sub(r'`[^`]*`', '', line)):
            if re.match(r'^[a-z][a-z0-9+.-]*:', target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition('#')
            dest = (os.path.normpath(os.path.join(os.path.dirname(path), file_part))
                    if file_part else path)
            where = '%s:%d: %s' % (os.path.relpath(path, ROOT), number, target)
            if not os.path.exists(dest):
                broken.append('%s (no such file or folder)' % where)
            elif anchor and dest.endswith('.md') and anchor not in anchors(dest):
                broken.append('%s (no heading with this anchor in %s)' %
                              (where, os.path.relpath(dest, ROOT)))
    return broken


def main():
    files = sys.argv[1:] or [os.path.join(ROOT, 'README.md')] + sorted(
        glob.glob(os.path.join(ROOT, 'docs', '*.md')))
    broken = [b for f in files for b in check(os.path.abspath(f))]
    for b in broken:
        print(b)
    links = sum(len(LINK.findall(re.sub(r'`[^`]*`', '', l)))
                for f in files for _, l in lines_outside_fences(os.path.abspath(f)))
    print('%d files, %d links, %d broken' % (len(files), links, len(broken)))
    return 1 if broken else 0


if __name__ == '__main__':
    sys.exit(main())
