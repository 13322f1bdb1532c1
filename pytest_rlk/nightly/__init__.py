"""Nightly runs over several machines: a plan (``plan.py``), one pytest job per node through Ray
(``node_job.py`` runs on the node, ``ray_driver.py`` submits and collects), and one verdict over
the runs of every platform (``verdict.py``, ``verdict_report.py``). See docs/nightly.md."""
