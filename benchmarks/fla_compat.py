"""flash-linear-attention's own Gated DeltaNet tests run against fuselm's functions (issue 20).

    python benchmarks/fla_compat.py TEST_GDN_PY [--out DIR] [-k EXPR] [pytest args ...]

On a CPU (Triton interpreter, TRITON_INTERPRET=1) the tests run on ``cpu``: slow past the smallest
shapes (``-k T63``); the GPU run is ``scripts/gpu_train.sh fla``.

TEST_GDN_PY is FLA's ``tests/ops/test_gdn.py`` (not shipped in the fla-core wheel: fetched from
the FLA repository into the git-ignored ``.fla_tests/``, its commit in ``.fla_tests/SOURCE``).
Before the test module is imported, ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` and
``fused_recurrent_gated_delta_rule`` become fuselm's (``chunk_gdn`` too), so every test that calls
them runs fuselm's kernels against FLA's references and tolerances; tests of FLA internals (its gate
kernel, WY helpers, FlashQLA backend) are deselected. Some tests of an option compare two calls of
the same (patched) function, e.g. the in-kernel gate against the gate computed outside: against
fuselm those check only self-consistency (fuselm computes the options with PyTorch ops before its
kernels), not FLA's reference. Writes ``fla_compat.md``: the outcome of
each test and the counts, with the reason of each failure's first line.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

# FLA internals the file also tests (not fuselm's functions): left out.
DESELECT = "not flash_qla and not test_gate and not wy_repr and not blackwell and not gdn_kernels"


class UseFuselm:
    """pytest plugin: FLA's GDN entry points replaced by fuselm's before collection; each outcome
    kept and the report rewritten after every test (a run cut short by a time limit still has one)."""

    def __init__(self, write_report):
        self.outcomes: dict[str, tuple[str, str]] = {}
        self.write_report = write_report

    def pytest_configure(self, config):
        import fla.ops.gated_delta_rule as fla_gdn

        from fuselm.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        fla_gdn.chunk_gated_delta_rule = fla_gdn.chunk_gdn = chunk_gated_delta_rule
        fla_gdn.fused_recurrent_gated_delta_rule = fused_recurrent_gated_delta_rule
        if not torch.cuda.is_available():  # CPU: fuselm's kernels in the Triton interpreter
            import fla.utils

            fla.utils.device = "cpu"

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            reason = ""
            if report.failed:
                reason = str(report.longrepr).strip().splitlines()[-1][:200] if report.longrepr else ""
            elif report.skipped and isinstance(report.longrepr, tuple):
                reason = report.longrepr[2][:200]
            if report.nodeid not in self.outcomes or report.outcome != "passed":
                self.outcomes[report.nodeid] = (report.outcome, reason)
                self.write_report(self.outcomes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test_file", type=Path)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k, combined with the deselection")
    args, pytest_args = parser.parse_known_args()
    keyword = DESELECT if args.keyword is None else f"({args.keyword}) and {DESELECT}"
    source = args.test_file.parent / "SOURCE"
    args.out.mkdir(parents=True, exist_ok=True)

    def write_report(outcomes) -> list[str]:
        counts = Counter(outcome for outcome, _ in outcomes.values())
        lines = [f"# FLA's test_gdn.py against fuselm ({datetime.date.today().isoformat()})", "",
                 f"Command: `python {' '.join(sys.argv)}`; FLA tests at "
                 f"`{source.read_text().strip() if source.exists() else 'unknown commit'}`; selected: `{keyword}`.", "",
                 "| outcome | tests |", "|---|---|"] + [f"| {k} | {v} |" for k, v in sorted(counts.items())]
        lines += ["", "| test | outcome | reason |", "|---|---|---|"]
        lines += [f"| {node.split('::', 1)[-1]} | {outcome} | {reason.replace('|', '/')} |"
                  for node, (outcome, reason) in sorted(outcomes.items())]
        (args.out / "fla_compat.md").write_text("\n".join(lines) + "\n")
        return lines

    plugin = UseFuselm(write_report)
    code = pytest.main([str(args.test_file), "-q", "-p", "no:cacheprovider", "-k", keyword, *pytest_args],
                       plugins=[plugin])
    print("\n".join(write_report(plugin.outcomes)[:12]))
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
