"""The Airflow UI plugin: the Execution Status page (:mod:`scheduler_lib.airflow.ui`)
mounted on the api-server, with an entry in the *Browse* menu and a tab on every DAG run.

Airflow loads it from the plugins folder (``plugins/scheduler_lib_plugin.py`` imports
this class). In the UI the page shows at ``/plugin/execution-status`` and the DAG run tab
at ``/dags/<dag>/runs/<run>/plugin/execution-status-run``; the UI replaces ``{DAG_ID}``
and ``{RUN_ID}`` in the tab's ``href`` with the run it shows.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from scheduler_lib.airflow import ui

PAGE_ROUTE = "execution-status"  # the UI's /plugin/<url_route>
RUN_TAB_ROUTE = "execution-status-run"  # the DAG run's tab: /dags/…/runs/…/plugin/<url_route>


class SchedulerLibPlugin(AirflowPlugin):
    """The Execution Status page and its DAG run tab."""

    name = "scheduler_lib"
    fastapi_apps = [
        {
            "app": ui.create_app(),
            "url_prefix": ui.URL_PREFIX,
            "name": "scheduler_lib Execution Status",
        }
    ]
    external_views = [
        {
            "name": "Execution Status",
            "href": f"{ui.URL_PREFIX}/",
            "icon": f"{ui.URL_PREFIX}/static/icon.svg",
            "destination": "nav",
            "category": "browse",
            "url_route": PAGE_ROUTE,
        },
        {
            "name": "Execution Status",
            "href": f"{ui.URL_PREFIX}/dags/{{DAG_ID}}/runs/{{RUN_ID}}",
            "icon": f"{ui.URL_PREFIX}/static/icon.svg",
            "destination": "dag_run",
            "url_route": RUN_TAB_ROUTE,
        },
    ]
