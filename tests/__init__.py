"""The Python test suites (pytest); shared infrastructure lives in prkit/."""
