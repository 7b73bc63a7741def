import pytest


@pytest.fixture(scope="session")
def default_model():
    from kvcompress.models import load_model

    return load_model(None)
