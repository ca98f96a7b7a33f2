import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, max_examples=50, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.register_profile("deep", max_examples=5000, deadline=None, stateful_step_count=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
