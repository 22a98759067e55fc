"""The compiled packing op against the pure torch path, its op builder, dispatch and report."""
