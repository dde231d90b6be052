"""Tasks (`task=`): data, prompts, verifiable rewards and grading for one benchmark each."""
