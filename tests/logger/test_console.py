"""Console output: the per-iteration summary line, and quiet behaviour in a non-interactive log."""

from __future__ import annotations

import logging

from prmppo.logger import console


def test_summary_line_shows_the_metrics_present_with_their_labels():
    line = console.summary_line("ppo[prm]", 11, 100, {"rollout/accuracy": 0.53125, "ppo/kl_ref": 0.00314,
                                                       "eval/test_greedy_accuracy": 0.5, "other": 1.0})
    assert line == "ppo[prm] it 12/100 acc 0.531 kl 0.0031 test 0.500"


def test_non_interactive_log_gets_no_bars_and_every_tenth_summary(monkeypatch, caplog):
    monkeypatch.setattr(console, "interactive", lambda: False)
    assert console.progress(range(3), desc="x").disable
    with caplog.at_level(logging.INFO, logger="prmppo"):
        for iteration in range(25):
            console.print_summary("ppo[orm]", iteration, 25, {"rollout/accuracy": 0.5}, enabled=True)
    assert [r.getMessage().split()[2] for r in caplog.records] == ["1/25", "11/25", "21/25", "25/25"]


def test_console_off_prints_nothing_even_on_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(console, "interactive", lambda: True)
    assert console.progress(range(3), desc="x", enabled=False).disable
    bar = console.progress(range(3), desc="x", enabled=True)
    assert not bar.disable
    bar.close()
    capsys.readouterr()  # the enabled bar's own output
    console.print_summary("ppo[orm]", 0, 5, {"rollout/accuracy": 0.5}, enabled=False)
    assert capsys.readouterr().err == ""


def test_training_milestones_reach_a_quiet_log_every_tenth_of_the_steps(monkeypatch, caplog):
    monkeypatch.setattr(console, "interactive", lambda: False)
    with caplog.at_level("INFO", logger="prmppo"):
        for step in range(25):
            console.log_milestone("sft", step, 25, {"loss": 0.5}, enabled=True)
        console.log_milestone("prm", 0, 25, {"loss": 0.5}, enabled=False)  # logger.console=false
    lines = [r.getMessage() for r in caplog.records]
    # 25 // 10 = 2: every second step, and the last
    assert lines == [f"sft step {n}/25 loss 0.500" for n in range(2, 25, 2)] + ["sft step 25/25 loss 0.500"]
    monkeypatch.setattr(console, "interactive", lambda: True)  # bars show progress on a terminal
    with caplog.at_level("INFO", logger="prmppo"):
        caplog.clear()
        console.log_milestone("sft", 1, 25, {"loss": 0.5}, enabled=True)
    assert caplog.records == []
