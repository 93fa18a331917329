#!/usr/bin/env python3
"""Every code block of README.md and docs/*.md, compiled, run or marked.

A fenced block's kind is its info string; an HTML comment on the line just
before the fence (invisible on GitHub) may say how it is checked:

  ```cpp       a fragment: compiled as the body of a function, with every
               public header and tests/docs/snippet_prelude.h (the names a
               snippet leaves to the reader: Model, LoadFromDisk, ...)
               included; its own #include lines move to file scope.
  <!-- snippet: program -->   ```cpp at file scope (declarations, main).
  ```python    run with this interpreter against the built package, in an
               empty temporary folder, within 120 s.
  <!-- snippet: syntax-only (REASON) -->   ```python compiled, not run; the
               reason (a running daemon, a GPU) is required.
  <!-- snippet: output-of COMMAND [drop-column NAME] -->   a block that shows
               output: COMMAND runs in the repository root (build/ is this
               build's folder), and every line of the block must be a line of
               its output, spaces aside (NAME: a column left out of the block,
               such as the measured req/s).
  <!-- snippet: illustration -->   shown, not run: a shell session, a
               synopsis, an output that depends on the machine.

A ```sh or ```console block that shows output (a line starting with "# " or
"$ ") and any block without an info string must carry a marker: each is then
either checked or declared an illustration. An unknown marker is an error.

Usage:
  snippets.py cpp ROOT OUT.cc        write the translation unit the build
                                     compiles (CMake: doc_snippets)
  snippets.py check --root DIR --build DIR [--python-dir DIR] [--cc FILE]
                    [--outputs]      check every block; with --cc, that FILE
                                     is the unit this checkout gives (the
                                     build compiled the current docs); with
                                     --outputs, run the output-of commands
"""

import argparse
import ast
import glob
import os
import re
import shlex
import subprocess
import sys
import tempfile

MARKER = re.compile(r"^<!--\s*snippet:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)```(.*)$")


class Block:
    def __init__(self, path, line, info, marker, text):
        self.path = path      # as given (relative to the root)
        self.line = line      # 1-based line of the first line of code
        self.info = info      # the info string's first word, or ""
        self.marker = marker  # the marker's text, or None
        self.text = text

    def where(self):
        return f"{self.path}:{self.line - 1}"


def blocks(root, path):
    """The fenced blocks of one Markdown file."""
    lines = open(os.path.join(root, path), encoding="utf-8").read().split("\n")
    out = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, info = m.group(1), m.group(2).strip()
        marker = None
        j = i - 1
        if j >= 0:
            mm = MARKER.match(lines[j].strip())
            if mm:
                marker = mm.group(1)
        start = i + 1
        k = start
        while k < len(lines) and not lines[k].startswith(indent + "```"):
            k += 1
        if k == len(lines):
            raise SystemExit(f"{path}:{i + 1}: a code block that never ends")
        body = [l[len(indent):] if l.startswith(indent) else l
                for l in lines[start:k]]
        out.append(Block(path, start + 1, info.split()[0] if info else "",
                         marker, "\n".join(body)))
        i = k + 1
    return out


def markdown_files(root):
    files = ["README.md"] + sorted(
        os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "docs", "*.md")))
    return files


def cpp_unit(root, files):
    """One translation unit: every C++ block, each where it came from."""
    includes, bodies = [], []
    n = 0
    for path in files:
        for b in blocks(root, path):
            if b.info not in ("cpp", "c++"):
                continue
            if b.marker not in (None, "program"):
                raise SystemExit(f"{b.where()}: a C++ block is a fragment or "
                                 f"'program', not '{b.marker}'")
            n += 1
            code = []
            for l in b.text.split("\n"):
                if l.lstrip().startswith("#include"):
                    includes.append(l.strip())
                    code.append("")  # keeps the line numbers
                else:
                    code.append(l)
            source = os.path.join(root, path).replace("\\", "/")
            line = f'#line {b.line} "{source}"'
            if b.marker == "program":
                # main becomes a function of the snippet's namespace, which
                # may end without a return as main does.
                bodies.append(
                    f"namespace snippet_{n} {{\n#define main snippet_main\n"
                    '#pragma GCC diagnostic push\n'
                    '#pragma GCC diagnostic ignored "-Wreturn-type"\n'
                    f"{line}\n" + "\n".join(code) + "\n#pragma GCC diagnostic pop\n"
                    f"#undef main\n}}  // namespace snippet_{n}\n")
            else:
                bodies.append(f"[[maybe_unused]] void Snippet{n}() {{\n{line}\n"
                              + "\n".join(code) + "\n}\n")
    head = ["// Generated by tests/docs/snippets.py from README.md and docs/*.md:",
            "// every C++ block, so that one that stops compiling fails the build.",
            '#include "snippet_prelude.h"']
    head += sorted(set(includes))
    return "\n".join(head) + "\n\n" + "\n".join(bodies), n


def normalise(line):
    return " ".join(line.split())


def drop_column(output, name):
    """The output with the column headed `name` cut out of the table."""
    lines = output.split("\n")
    for h, header in enumerate(lines):
        m = re.search(r"(?:^|\s)(" + re.escape(name) + r")(?=\s|$)", header)
        if not m:
            continue
        before = header[:m.start(1)].rstrip()
        start, end = len(before), m.end(1)
        cut = []
        for l in lines[h:]:
            if not l.strip():
                cut.append(l)
                break
            cut.append(l[:start] + l[end:])
        k = h + len(cut)
        return "\n".join(lines[:h] + cut + lines[k:])
    raise ValueError(f"no column '{name}' in the output")


OUTPUTS = {}


def check_output(b, root, build):
    words = shlex.split(b.marker)[1:]
    column = None
    if "drop-column" in words:
        k = words.index("drop-column")
        column = words[k + 1]
        words = words[:k] + words[k + 2:]
    words = [os.path.join(build, w[len("build/"):]) if w.startswith("build/") else w
             for w in words]
    key = tuple(words)
    if key not in OUTPUTS:  # blocks that show one command's output run it once
        # A temporary folder of its own: what the command writes there (the
        # embedded default's report) meets no other test's files.
        with tempfile.TemporaryDirectory(prefix="modelcache-snippet-") as tmp:
            OUTPUTS[key] = subprocess.run(words, cwd=root, capture_output=True, text=True,
                                          timeout=300, env=dict(os.environ, TMPDIR=tmp))
    run = OUTPUTS[key]
    if run.returncode != 0:
        return [f"{b.where()}: `{' '.join(words)}` exited {run.returncode}: "
                f"{run.stderr.strip()[-500:]}"]
    output = drop_column(run.stdout, column) if column else run.stdout
    have = {normalise(l) for l in output.split("\n")}
    errors = []
    for i, l in enumerate(b.text.split("\n")):
        if l.strip() and normalise(l) not in have:
            errors.append(f"{b.path}:{b.line + i}: not in the output of "
                          f"`{' '.join(words)}`: {l.strip()}")
    return errors


def shows_output(b):
    return any(l.startswith("# ") or l.startswith("$ ") for l in b.text.split("\n"))


def slug(heading):
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path):
    out, fence = set(), False
    for l in open(path, encoding="utf-8"):
        if l.startswith("```"):
            fence = not fence
        elif not fence and l.startswith("#"):
            out.add(slug(l.lstrip("#")))
    return out


LINK = re.compile(r"\]\(([^)\s]+)\)")


def check_links(root, path):
    """Every relative link of a page names a file there, and a heading."""
    errors, fence = [], False
    for n, l in enumerate(open(os.path.join(root, path), encoding="utf-8"), 1):
        if l.startswith("```"):
            fence = not fence
        if fence:
            continue
        for target in LINK.findall(l):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(root, os.path.dirname(path), file)) \
                if file else os.path.join(root, path)
            if not os.path.exists(full):
                errors.append(f"{path}:{n}: the link {target} names no file")
            elif anchor and full.endswith(".md") and anchor not in anchors(full):
                errors.append(f"{path}:{n}: the link {target} names no heading")
    return errors


def check(args):
    errors, counts = [], {}
    for path in markdown_files(args.root):
        errors += check_links(args.root, path)
    python_env = dict(os.environ)
    if args.python_dir:
        python_env["PYTHONPATH"] = os.path.abspath(args.python_dir)
    for path in markdown_files(args.root):
        for b in blocks(args.root, path):
            kind = b.marker.split()[0] if b.marker else None
            if kind not in (None, "program", "syntax-only", "output-of", "illustration"):
                errors.append(f"{b.where()}: unknown snippet marker '{b.marker}'")
                continue
            if b.info in ("cpp", "c++"):
                counts["cpp compiled"] = counts.get("cpp compiled", 0) + 1
                continue  # cpp_unit checks its markers
            if b.info == "python":
                if kind == "syntax-only":
                    if not re.search(r"\(.+\)", b.marker):
                        errors.append(f"{b.where()}: syntax-only needs a reason in ()")
                    try:
                        ast.parse(b.text, filename=b.where())
                    except SyntaxError as e:
                        errors.append(f"{b.where()}: {e}")
                    counts["python syntax-checked"] = counts.get("python syntax-checked", 0) + 1
                    continue
                if kind not in (None,):
                    errors.append(f"{b.where()}: a Python block runs, or is "
                                  f"'syntax-only (REASON)', not '{b.marker}'")
                    continue
                if not args.python_dir:  # a build without the package
                    try:
                        ast.parse(b.text, filename=b.where())
                    except SyntaxError as e:
                        errors.append(f"{b.where()}: {e}")
                    counts["python syntax-checked (no package here)"] = counts.get(
                        "python syntax-checked (no package here)", 0) + 1
                    continue
                with tempfile.TemporaryDirectory(prefix="modelcache-snippet-") as d:
                    script = os.path.join(d, "snippet.py")
                    # Blank lines first, so a traceback names the Markdown line.
                    open(script, "w").write("\n" * (b.line - 1) + b.text + "\n")
                    run = subprocess.run([sys.executable, script], cwd=d, env=python_env,
                                         capture_output=True, text=True, timeout=120)
                if run.returncode != 0:
                    errors.append(f"{b.where()}: the Python block failed "
                                  f"({run.returncode}):\n{run.stderr.replace(script, b.path)}")
                counts["python run"] = counts.get("python run", 0) + 1
                continue
            if kind == "output-of":
                if args.outputs:
                    errors += check_output(b, args.root, args.build)
                    counts["output checked"] = counts.get("output checked", 0) + 1
                else:  # a sanitizer build: the release build checks them
                    counts["output not checked here"] = counts.get(
                        "output not checked here", 0) + 1
                continue
            if kind == "illustration":
                counts["illustration"] = counts.get("illustration", 0) + 1
                continue
            if kind is not None:
                errors.append(f"{b.where()}: '{kind}' is for C++ or Python blocks")
                continue
            if not b.info:
                errors.append(f"{b.where()}: a block without an info string needs a "
                              "marker (<!-- snippet: illustration --> or output-of)")
            elif b.info in ("sh", "console", "bash") and shows_output(b):
                errors.append(f"{b.where()}: a shell block that shows output needs a "
                              "marker (<!-- snippet: illustration --> or output-of)")
            else:
                counts["commands, not run"] = counts.get("commands, not run", 0) + 1
    if args.cc:
        want, _ = cpp_unit(args.root, markdown_files(args.root))
        have = open(args.cc, encoding="utf-8").read()
        if want != have:
            errors.append(f"{args.cc} is not the C++ of the docs now: rebuild "
                          "(the target doc_snippets compiles it)")
    for e in errors:
        print("error:", e, file=sys.stderr)
    print(", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    return 1 if errors else 0


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("cpp")
    c.add_argument("root")
    c.add_argument("out")
    k = sub.add_parser("check")
    k.add_argument("--root", required=True)
    k.add_argument("--build", required=True)
    k.add_argument("--python-dir")
    k.add_argument("--cc")
    k.add_argument("--outputs", action="store_true",
                   help="run the commands of output-of blocks (the release build)")
    args = parser.parse_args()
    if args.command == "cpp":
        unit, _ = cpp_unit(args.root, markdown_files(args.root))
        old = open(args.out).read() if os.path.exists(args.out) else None
        if old != unit:  # unchanged docs rebuild nothing
            open(args.out, "w").write(unit)
        return 0
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
