"""Loading policies: text or a file in, a checked `CompiledPolicy` out."""

from __future__ import annotations

from pathlib import Path

from engine.errors import PolicyError
from engine.policy import EngineCapabilities
from policy_lang.check import check
from policy_lang.prefill import check_prefill
from policy_lang.compile import build
from policy_lang.diagnostics import check_error
from policy_lang.loader import load_rules
from policy_lang.runtime import CompiledPolicy


def compile_policy(text: str, *, filename: str = "<string>", base_dir: Path | None = None,
                   capabilities: EngineCapabilities | None = None) -> CompiledPolicy:
    """Parse, check and compile policy text. `base_dir` is where `include` and `extends` paths
    start (default: the directory of `filename`, or the current one). With `capabilities`,
    a policy that needs a mechanism the engine lacks is refused too.

    Raises PolicySyntaxError or PolicyCheckError (both PolicyErrors) with every problem found,
    each as `FILE:LINE:COL: message`, the source line and a caret."""
    if base_dir is None:
        base_dir = Path(filename).parent if not filename.startswith("<") else Path.cwd()
    rules, diags = load_rules(text, filename, base_dir)
    if not diags:
        diags = check(rules) + check_prefill(rules)
    if diags:
        raise check_error(diags, rules.sources)
    policy = build(rules, source=text, filename=filename, base_dir=base_dir)
    if capabilities is not None:
        policy.check_supported(capabilities)
    return policy


def load_policy_file(path: str | Path, *,
                     capabilities: EngineCapabilities | None = None) -> CompiledPolicy:
    """Read and compile a `.policy` file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read the policy file: {exc.strerror or exc}") from None
    return compile_policy(text, filename=str(path), base_dir=path.parent, capabilities=capabilities)
