"""matplotlib is the ``plot`` extra: nothing imports it until a plot is drawn, and a command
that would draw plots without it stops first with an error naming the extra."""

import subprocess
import sys

import pytest

from radixserve.cli import main


def test_serving_and_reports_import_without_matplotlib():
    code = (
        "import sys\n"
        "import radixserve.cli, radixserve.server.app, radixserve.bench.report, "
        "radixserve.sim.report, radixserve.sim.grid\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["simulate", "--kv-tokens", "2000", "--sessions", "2"], "or pass --no-plots"),
        (["simulate", "replay", "--kv-tokens", "2000", "--sessions", "2"], "or pass --no-plots"),
        (["bench", "--workload", "random", "--num-prompts", "1"], "radixserve bench writes plots"),
    ],
)
def test_plots_without_matplotlib_are_a_clear_error(argv, hint, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("radixserve.utils.plots_available", lambda: False)
    monkeypatch.setattr("radixserve.bench.cli.plots_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--output-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "pip install 'radixserve[plot]'" in err and hint in err
    assert not any(tmp_path.iterdir())  # stopped before running anything
