"""Resolve `extends` and `include` into one set of effective rules.

`extends "base.policy"` starts from every rule of the base policy; the file's own rules replace
the base's rules with the same key (`priority rt`, `class be`, `preempt`, each memory setting...).
`include "part.policy"` splices the statements of another file in place; a later statement with
the same key wins, so a policy can include shared classes and then refine one of them. Paths are
relative to the file that names them. Two rules with the same key written in one file is an
error (it is almost always a typo), and so is a cycle of includes or extends.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from policy_lang import ast
from policy_lang.diagnostics import Diagnostic, Span
from policy_lang.parser import parse


@attrs.define
class RuleSet:
    """The effective rules of a policy, after extends and includes."""

    name: str
    file: str
    rules: dict[ast.RuleKey, ast.Node] = attrs.field(factory=dict)
    """Key -> the statement that sets it (a `MemSetting` for memory keys)."""
    sources: dict[str, str] = attrs.field(factory=dict)
    """File name -> text, for error reports and `policy explain`."""
    top: ast.PolicyFile | None = None

    def get(self, *key: str) -> ast.Node | None:
        return self.rules.get(key)

    def all(self, kind: str) -> list[ast.Node]:
        return [v for k, v in self.rules.items() if k[0] == kind]


class _Loader:
    def __init__(self, rules: RuleSet) -> None:
        self.rules = rules
        self.diags: list[Diagnostic] = []
        self.stack: list[Path] = []

    def error(self, span: Span, message: str) -> None:
        self.diags.append(Diagnostic(span=span, message=message))

    def load_file(self, tree: ast.PolicyFile, path: Path | None, base_dir: Path) -> None:
        if path is not None:
            self.stack.append(path)
        if tree.extends is not None:
            base = self.open(tree.extends, base_dir, "extend")
            if base is not None:
                btree, bpath = base
                if btree.is_fragment:
                    self.error(tree.extends.span, f'cannot extend "{tree.extends.value}": it is a '
                               "fragment, not a policy (include it instead)")
                else:
                    self.load_file(btree, bpath, bpath.parent)
        self.apply(tree.body, base_dir)
        if path is not None:
            self.stack.pop()

    def apply(self, body: tuple[ast.Statement, ...], base_dir: Path) -> None:
        own: dict[ast.RuleKey, Span] = {}
        for stmt in body:
            if isinstance(stmt, ast.Include):
                self.include(stmt, base_dir)
                continue
            for key, node in _entries(stmt):
                first = own.get(key)
                if first is not None:
                    self.error(node.span, f"{ast.describe_key(key)} is already set at line "
                               f"{first.line}")
                    continue
                own[key] = node.span
                self.set(key, node)

    def set(self, key: ast.RuleKey, node: ast.Node) -> None:
        old = self.rules.rules.get(key)
        if isinstance(node, ast.Rerank) and node.schedule is None and isinstance(old, ast.Rerank):
            node = attrs.evolve(node, schedule=old.schedule)
        self.rules.rules[key] = node

    def include(self, stmt: ast.Include, base_dir: Path) -> None:
        opened = self.open(stmt.path, base_dir, "include")
        if opened is None:
            return
        tree, path = opened
        if tree.extends is not None:
            self.error(stmt.path.span, f'cannot include "{stmt.path.value}": it extends another '
                       "policy (extend it instead)")
            return
        self.stack.append(path)
        self.apply(tree.body, path.parent)
        self.stack.pop()

    def open(self, ref: ast.String, base_dir: Path, verb: str) -> tuple[ast.PolicyFile, Path] | None:
        path = Path(os.path.normpath(base_dir / ref.value))
        resolved = path.resolve()
        chain = [p.resolve() for p in self.stack]
        if resolved in chain:
            cycle = " -> ".join(p.name for p in self.stack[chain.index(resolved):] + [path])
            self.error(ref.span, f"{'include' if verb == 'include' else 'extends'} cycle: {cycle}")
            return None
        try:
            text = path.read_text()
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            self.error(ref.span, f'cannot {verb} "{ref.value}": {reason} ({path})')
            return None
        name = str(path)
        self.rules.sources[name] = text
        return parse(text, name), path


def _entries(stmt: ast.Statement) -> list[tuple[ast.RuleKey, ast.Node]]:
    if isinstance(stmt, ast.Memory):
        return [(("memory", s.name.name), s) for s in stmt.settings]
    return [(key, stmt) for key in ast.rule_keys(stmt)]


def load_rules(text: str, filename: str, base_dir: Path) -> tuple[RuleSet, list[Diagnostic]]:
    """Parse `text` and everything it extends or includes. Syntax errors raise
    PolicySyntaxError (in whichever file they are); other problems come back as diagnostics."""
    tree = parse(text, filename)
    name = tree.name.name if tree.name else Path(filename).stem
    rules = RuleSet(name=name, file=filename, sources={filename: text}, top=tree)
    loader = _Loader(rules)
    path = None if filename.startswith("<") else Path(filename)
    loader.load_file(tree, path, base_dir)
    return rules, loader.diags
