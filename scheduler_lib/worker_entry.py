"""``spark-submit`` entry script of the Spark worker: the same as ``scheduler-lib worker``,
for clusters that start drivers themselves (standalone, YARN, Kubernetes)::

    spark-submit --master spark://host:7077 $(scheduler-lib worker --entry-script) \\
        --db postgresql+psycopg://... --queue QueueAsyncTarget

The master and the Spark settings come from spark-submit's command line.
"""

import sys

from scheduler_lib.cli import main

if __name__ == "__main__":
    sys.exit(main(["worker", *sys.argv[1:]]))
