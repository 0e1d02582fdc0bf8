"""The Ray services of albert: preprocess, train, coordinator, eval, jobs and the CLI (albert_core holds the math)."""

RAY_NAMESPACE = "albert"  # every named actor (coordinators, evaluators) and driver of albert lives here
