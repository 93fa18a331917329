#!/usr/bin/env python3
"""snippets.py refuses what it exists to refuse: each case is a page with one
fault, and the check must fail naming its line; a page without one passes.

    snippets_selftest.py SNIPPETS_PY
"""

import os
import subprocess
import sys
import tempfile

SNIPPETS = sys.argv[1]

GOOD = """# A page

```python
print("ok")
```

<!-- snippet: syntax-only (it needs a daemon) -->
```python
import nothing_installed_here
```

<!-- snippet: illustration -->
```sh
make demo
# a table
```

```cpp
int x = 1;
```

<!-- snippet: program -->
```cpp
#include <cstdio>
int main() { std::puts("hi"); }
```

A [link](other.md#a-heading) and one [to a file](../README.md).
"""

# (what is wrong, the page's text, what the error must say)
FAULTS = [
    ("a Python block that raises", "```python\nraise ValueError('x')\n```\n",
     "docs/page.md:1: the Python block failed"),
    ("a Python block that does not parse, marked syntax-only",
     "<!-- snippet: syntax-only (a daemon) -->\n```python\ndef (:\n```\n", "docs/page.md:2"),
    ("syntax-only without a reason",
     "<!-- snippet: syntax-only -->\n```python\npass\n```\n", "needs a reason"),
    ("a block without an info string and no marker", "```\noutput\n```\n",
     "docs/page.md:1: a block without an info string"),
    ("a shell block that shows output, unmarked", "```sh\nls\n# a b c\n```\n",
     "docs/page.md:1: a shell block that shows output"),
    ("an unknown marker", "<!-- snippet: compiled -->\n```python\npass\n```\n",
     "unknown snippet marker"),
    ("a link to no file", "See [this](missing.md).\n", "docs/page.md:1: the link missing.md"),
    ("a link to no heading", "See [this](other.md#nowhere).\n", "names no heading"),
    ("an output that the command does not print",
     "<!-- snippet: output-of echo hello -->\n```text\ngoodbye\n```\n",
     "docs/page.md:3: not in the output of `echo hello`: goodbye"),
]


def run_check(page, outputs=True):
    with tempfile.TemporaryDirectory(prefix="modelcache-snippets-selftest-") as root:
        os.mkdir(os.path.join(root, "docs"))
        open(os.path.join(root, "README.md"), "w").write("# Top\n")
        open(os.path.join(root, "docs", "other.md"), "w").write("# A heading\n")
        open(os.path.join(root, "docs", "page.md"), "w").write(page)
        args = [sys.executable, SNIPPETS, "check", "--root", root, "--build", root,
                "--python-dir", root]
        if outputs:
            args.append("--outputs")
        run = subprocess.run(args, capture_output=True, text=True, timeout=120)
        unit = subprocess.run([sys.executable, SNIPPETS, "cpp", root,
                               os.path.join(root, "unit.cc")], capture_output=True, text=True)
        text = open(os.path.join(root, "unit.cc")).read() if unit.returncode == 0 else ""
        return run, text


def main():
    failures = []
    run, unit = run_check(GOOD)
    if run.returncode != 0:
        failures.append(f"a good page fails:\n{run.stderr}")
    if '#line 19 "' not in unit or "namespace snippet_2" not in unit \
            or "#include <cstdio>" not in unit:
        failures.append(f"the C++ unit does not say where each block came from:\n{unit}")
    for what, page, expected in FAULTS:
        run, _ = run_check(page)
        if run.returncode == 0 or expected not in run.stderr:
            failures.append(f"{what}: status {run.returncode}, expected '{expected}' in:\n"
                            f"{run.stderr}")
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    print(f"{1 + len(FAULTS) - len(failures)} of {1 + len(FAULTS)} cases as expected")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
