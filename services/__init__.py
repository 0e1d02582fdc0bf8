"""The Ray services of albert: preprocess, train, coordinator, eval, jobs and the CLI (albert_core holds the math)."""

RAY_NAMESPACE = "albert"  # every named actor (coordinators, evaluators) and driver of albert lives here
__version__ = "0.1.0"  # the package version (pyproject.toml reads it): `albert --version`
