"""Review 2: a --set whose value is not valid YAML is a ProfileError naming the override (the CLI
prints those as one line), not a raw yaml traceback."""

from __future__ import annotations

import pytest

from omniloop.profile import ProfileError, load_profile


@pytest.mark.parametrize("item", ["model_dir=[abc", "stages.talker.options={step_ms: 1", "seed=: :"])
def test_a_set_value_that_is_not_yaml_is_a_profile_error(item: str) -> None:
    with pytest.raises(ProfileError, match="--set"):
        load_profile("fake", [item], platform="cpu")
