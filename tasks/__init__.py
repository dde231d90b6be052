"""Tasks (`task=`): data, prompts, verifiable rewards and grading for one benchmark each.

Importing this package registers every built-in task.
"""

from gpo.tasks import aime24, amc23, arith, dataset, gsm8k, math  # noqa: F401  (registers the tasks)
