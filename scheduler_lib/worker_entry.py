"""``spark-submit`` entry script of the Spark worker: the same as ``scheduler-lib worker``,
for clusters that start drivers themselves (standalone, YARN, Kubernetes)::

    spark-submit --master spark://host:7077 $(scheduler-lib worker --entry-script) \\
        --db postgresql+psycopg://... --queue QueueAsyncTarget

The master and the Spark settings come from spark-submit's command line.
"""

import os
import sys

# Run as a script, this file has its own folder (the scheduler_lib package) first on
# sys.path, where the provider package scheduler_lib/airflow would be found as Airflow
# itself: a spark_submit task (the Spark provider imports airflow.sdk), or any task whose
# code imports airflow, failed with "No module named 'airflow.sdk'" in a worker started
# this way. The package is imported from where it is installed instead.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

from scheduler_lib.cli import main

if __name__ == "__main__":
    sys.exit(main(["worker", *sys.argv[1:]]))
