"""The research record: studies, notes and one-off study tools. The product never imports it."""
