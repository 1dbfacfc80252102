"""The round maths: the checks and robust means of aggregation, the outer step, the adaptive schedule and the one transition from a closed round to the next checkpoint."""
