"""The operator's controls (``delegation.operator``): judged when given, and cancel."""
