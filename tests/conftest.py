import specserve  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)

import pytest
import torch

torch.manual_seed(0)


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    from specserve.models.loader import default_model_path

    return default_model_path()
