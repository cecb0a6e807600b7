"""The resume conformance kit: a user's loader trained, killed and resumed on other numbers of processes, and what
it trained counted (``trainfold.testing.check_resume``)."""
