"""Replace one rule of a policy's source text (the REPL's `edit RULE`).

The rule replaces the statement that sets the same thing (`priority rt = ...` replaces
`priority rt = ...`, `preempt never` replaces `preempt ...`); a memory setting replaces only that
setting of the memory block; a rerank written without `every` keeps the schedule it replaces. A
rule the file does not set yet (it may come from the extended policy) is added before the
closing brace. The rest of the text, comments included, is left as it was.
"""

from __future__ import annotations

from policy_lang import ast
from policy_lang.parser import parse, parse_statement


def replace_rule(source: str, rule: str, *, filename: str = "<running>") -> str:
    """`source` with `rule` in place of the statement it overrides; raises PolicySyntaxError
    when either does not parse."""
    tree = parse(source, filename)
    stmt = parse_statement(rule.strip(), "<edit>")
    text = " ".join(rule.split())
    keys = set(ast.rule_keys(stmt))
    if not keys:
        return _insert(source, tree, text)
    old = next((s for s in tree.body if keys & set(ast.rule_keys(s))), None)
    if old is None:
        return _insert(source, tree, text)
    if isinstance(stmt, ast.Memory) and isinstance(old, ast.Memory):
        text = _merge_memory(source, old, stmt)
    elif isinstance(stmt, ast.Rerank) and stmt.schedule is None and isinstance(old, ast.Rerank) \
            and old.schedule is not None:
        text = f"{_slice(source, old.schedule)}: {text}"
    return source[:old.span.start] + text + source[old.span.end:]


def _slice(source: str, node: ast.Node) -> str:
    return source[node.span.start:node.span.end]


def _merge_memory(source: str, old: ast.Memory, new: ast.Memory) -> str:
    values = {s.name.name: s.value.name for s in old.settings}
    values.update({s.name.name: s.value.name for s in new.settings})
    return "memory { " + "; ".join(f"{k} {v}" for k, v in values.items()) + " }"


def _insert(source: str, tree: ast.PolicyFile, text: str) -> str:
    if tree.close is None:
        return source.rstrip("\n") + "\n" + text + "\n"
    at = tree.close.start
    line_start = source.rfind("\n", 0, at) + 1
    if source[line_start:at].strip():
        return source[:at].rstrip(" ") + f" {text} " + source[at:]
    return source[:line_start] + f"  {text}\n" + source[line_start:]
