"""The pieces of ``rlhfkit report``: what a run folder holds, the warning signs, the plots, the HTML page.

- :mod:`~rlhfkit.reporting.runs`: a run folder read once (metrics, summary, configuration, samples,
  held-out reward-model scores), and readable names for metric keys;
- :mod:`~rlhfkit.reporting.sample_file`: a tolerant reader of ``samples.jsonl``;
- :mod:`~rlhfkit.reporting.health`: the warning signs of a PPO run, each a stated rule;
- :mod:`~rlhfkit.reporting.plots`: matplotlib figures as PNG bytes;
- :mod:`~rlhfkit.reporting.page`: one self-contained ``report.html`` (plots inline, no network);
- :mod:`~rlhfkit.reporting.headline`: the lines ``rlhfkit train`` prints at the end of a run (paths, headline
  figures).

:mod:`rlhfkit.reporting.report` puts them together.
"""
