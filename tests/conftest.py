"""Suite-wide settings.

Property tests run derandomized by default so CI is reproducible; explore fresh
examples locally with ``pytest --hypothesis-profile=explore``.
"""

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile("ci")
