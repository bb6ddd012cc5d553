#!/usr/bin/env python3
"""Finds import circles between the files of a Rust crate.

A file imports another when it names an item through a `crate::`, `super::` or `self::`
path (in a `use` or inline) that resolves to that file; re-exports (`pub use`) are followed
to the file that defines the item, so `use crate::Qwen3Model` is an import of the model's
file, not of lib.rs, and a `pub use` is a module's interface, not an import of its own
(a `mod.rs` that only declares and re-exports imports nothing). Module declarations
(`mod x;`) are not imports. Prints every strongly
connected group of files with one circle through it, and exits 1 if there is any.

Usage: tools/import_cycles.py [--self-test] [CRATE_SRC_DIR ...]   (default: models/src train/src)
"""

import re
import sys
from pathlib import Path

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip(text):
    """Removes comments, string and char literals (keeps line structure)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and (i == 0 or not re.match(r"\w", text[i - 1])):
            m = re.match(r'r(#*)"', text[i:])
            end = text.find('"' + m.group(1), i + len(m.group(0)))
            i = n if end < 0 else end + 1 + len(m.group(1))
            out.append('""')
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            out.append('""')
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4] if text[i + 1:i + 2] != "\\" else text[i:i + 12]):
            m = re.match(r"'(\\[^']*|[^\\'])'", text[i:])
            i += len(m.group(0)) if m else 1
            out.append("' '")
        else:
            out.append(c)
            i += 1
    return "".join(out)


def inline_depths(text):
    """A function from a position in `text` to the number of inline modules around it."""
    opens, stack, spans = [], [], []
    depth = 0
    mods = {m.end() - 1 for m in re.finditer(r"\bmod\s+" + IDENT + r"\s*\{", text)}
    for i, ch in enumerate(text):
        if ch == "{":
            depth += 1
            if i in mods:
                stack.append((depth, i))
        elif ch == "}":
            if stack and stack[-1][0] == depth:
                spans.append((stack.pop()[1], i))
            depth -= 1
    return lambda pos: sum(1 for a, b in spans if a < pos < b)


def module_files(src):
    """Maps module paths (tuples) to files for one crate's src/ folder."""
    mods = {}
    for f in sorted(src.rglob("*.rs")):
        rel = f.relative_to(src).with_suffix("").parts
        if rel in (("lib",), ("main",)):
            path = ()
        elif rel[-1] == "mod":
            path = rel[:-1]
        else:
            path = rel
        if path == () and rel == ("main",) and () in mods:
            continue  # a bin next to a lib: its own crate; skip
        if rel and rel[0] == "bin":
            continue
        mods[path] = f
    return mods


def expand_use(tree):
    """`a::{b, c::{d, e}}` -> [a::b, a::c::d, a::c::e] (aliases dropped)."""
    tree = re.sub(r"\s*(::|\{|\}|,)\s*", r"\1", " ".join(tree.split()))
    depth, start = 0, None
    for i, ch in enumerate(tree):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                prefix, inner, rest = tree[:start], tree[start + 1:i], tree[i + 1:]
                parts, d, cur = [], 0, ""
                for c in inner:
                    if c == "," and d == 0:
                        parts.append(cur)
                        cur = ""
                        continue
                    d += c == "{"
                    d -= c == "}"
                    cur += c
                parts.append(cur)
                out = []
                for p in parts:
                    if p:
                        out += expand_use(prefix + p + rest)
                return out
    return [tree]


class Crate:
    def __init__(self, src):
        self.src = src
        self.mods = module_files(src)
        self.text = {m: strip(f.read_text()) for m, f in self.mods.items()}
        self.uses = {m: self._uses(t) for m, t in self.text.items()}
        # pub re-exports per module: name -> absolute path
        self.reexports = {}
        for m, t in self.text.items():
            ex = {}
            for vis, tree in re.findall(r"\b(pub(?:\([^)]*\))?\s+)use\s+([^;]+);", t):
                for p in self._split_uses(tree):
                    segs, alias = p
                    absp = self.absolute(m, segs)
                    if absp is not None and segs[-1] not in ("self", "*"):
                        ex[alias or segs[-1]] = absp
            self.reexports[m] = ex

    def _split_uses(self, tree):
        out = []
        for p in expand_use(" ".join(tree.split())):
            p = p.strip()
            alias = None
            m = re.match(r"^(.*?)\s*\bas\b\s*(" + IDENT + r")$", p)
            if m:
                p, alias = m.group(1), m.group(2)
            out.append((tuple(s for s in p.split("::") if s), alias))
        return out

    def _uses(self, t):
        depth = inline_depths(t)
        return [
            (depth(m.start()), bool(m.group(1)), self._split_uses(m.group(2)))
            for m in re.finditer(r"(\bpub(?:\([^)]*\))?\s+)?\buse\s+([^;]+);", t)
        ]

    def absolute(self, here, segs, inline=0):
        """Absolute module path of a `crate::`/`super::`/`self::` path, else None. `inline`:
        how many inline `mod x { .. }` blocks enclose the path (their `super` is the file)."""
        if not segs:
            return None
        base = list(here)
        i = 0
        if segs[0] == "crate":
            base, i = [], 1
        elif segs[0] in ("super", "self"):
            while i < len(segs) and segs[i] in ("super", "self"):
                if segs[i] == "super":
                    if inline:
                        inline -= 1
                    else:
                        base = base[:-1]
                i += 1
        else:
            first = segs[0]
            if tuple(base) + (first,) in self.mods:  # a child module named directly
                return tuple(base) + tuple(segs)
            return None
        return tuple(base) + tuple(segs[i:])

    def resolve(self, path, seen=None):
        """The module (file) that defines the item at absolute `path`."""
        seen = seen or set()
        for k in range(len(path), -1, -1):
            mod = path[:k]
            if mod in self.mods:
                rest = path[k:]
                if rest and rest[0] in self.reexports.get(mod, {}) and (mod, rest[0]) not in seen:
                    seen.add((mod, rest[0]))
                    return self.resolve(self.reexports[mod][rest[0]] + rest[1:], seen)
                return mod
        return None

    def edges(self, why=None):
        """Import edges; with `why` = {}, also the paths behind each edge."""
        why = {} if why is None else why
        g = {m: set() for m in self.mods}
        for m, t in self.text.items():
            aliases = {}
            targets = set()
            depth = inline_depths(t)
            for inline, public, group in self.uses[m]:
                for segs, alias in group:
                    absp = self.absolute(m, segs, inline)
                    if absp is None:
                        continue
                    if segs[-1] == "self":
                        absp = absp[:-1]
                        name = alias or (absp[-1] if absp else None)
                    else:
                        name = alias or segs[-1]
                    if absp and absp[-1] == "*":
                        absp = absp[:-1]
                    tgt = self.resolve(absp)
                    if tgt is not None:
                        if not public:
                            targets.add(tgt)
                            why.setdefault((m, tgt), set()).add("use " + "::".join(segs))
                        if tgt == absp and name:
                            aliases[name] = absp  # a module brought into scope
            code = re.sub(r"\buse\s+[^;]+;", lambda u: " " * len(u.group(0)), t)
            for mt in re.finditer(r"(?<![\w:])((?:crate|super|self)(?:::" + IDENT + r")+)", code):
                segs = tuple(mt.group(1).split("::"))
                absp = self.absolute(m, segs, depth(mt.start()))
                if absp is not None:
                    tgt = self.resolve(absp)
                    if tgt is not None:
                        targets.add(tgt)
                        why.setdefault((m, tgt), set()).add(mt.group(1))
            for name, modp in aliases.items():
                for mt in re.finditer(r"(?<![\w:])" + re.escape(name) + r"((?:::" + IDENT + r")+)", code):
                    tgt = self.resolve(modp + tuple(s for s in mt.group(1).split("::") if s))
                    if tgt is not None:
                        targets.add(tgt)
                        why.setdefault((m, tgt), set()).add(name + mt.group(1))
            targets.discard(m)
            g[m] = targets
        return g


def sccs(g):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(10000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def circle(g, comp):
    """One circle through the group's first file (breadth-first back to it)."""
    comp = set(comp)
    start = min(comp)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(g[v] & comp):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, v, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]


def main(dirs):
    bad = 0
    for d in dirs:
        crate = Crate(Path(d))
        why = {}
        g = crate.edges(why)
        name = lambda m: str(crate.mods[m].relative_to(Path(d)))
        groups = sccs(g)
        for comp in groups:
            bad += 1
            files = ", ".join(sorted(name(m) for m in comp))
            print(f"{d}: import circle among {files}")
            loop = circle(g, comp)
            print("    e.g. " + " -> ".join(name(m) for m in loop))
            for a, b in zip(loop, loop[1:]):
                print(f"      {name(a)} -> {name(b)}: " + ", ".join(sorted(why[(a, b)])[:4]))
        if not groups:
            print(f"{d}: no import circles ({len(g)} files)")
    return 1 if bad else 0


def self_test():
    """The checker finds a planted circle (through a re-export and an inline test module's
    `super`) and passes the same files once the circle is gone."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src = Path(d)
        (src / "m").mkdir()
        (src / "lib.rs").write_text("pub mod a;\npub mod m;\npub use m::b::Thing;\n")
        (src / "m" / "mod.rs").write_text("//! only re-exports\npub mod b;\npub use b::Thing;\n")
        (src / "a.rs").write_text(
            "use crate::Thing;\npub struct A;\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n"
        )
        (src / "m" / "b.rs").write_text('pub struct Thing(crate::a::A);\nconst S: &str = "crate::x";\n')
        g = Crate(src).edges()
        found = sccs(g)
        assert [sorted(c) for c in found] == [[("a",), ("m", "b")]], found
        (src / "m" / "b.rs").write_text("pub struct Thing;\n// crate::a::A in a comment\n")
        assert sccs(Crate(src).edges()) == [], "a comment or string is not an import"
    print("import_cycles self-test: ok")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--self-test"]:
        sys.exit(self_test())
    sys.exit(main(args or ["models/src", "train/src"]))
