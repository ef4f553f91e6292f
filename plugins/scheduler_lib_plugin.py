"""Airflow loads plugins from this folder: the Execution Status page of scheduler_lib
(``scheduler_lib.airflow.plugin``). Point ``[core] plugins_folder`` here, or copy this
file into your own plugins folder; the ``scheduler_lib`` package must be installed."""

from scheduler_lib.airflow.plugin import SchedulerLibPlugin

__all__ = ["SchedulerLibPlugin"]
