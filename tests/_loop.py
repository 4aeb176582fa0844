"""A train loop for tests: steps of `step(params, state, batch) -> (params, state, loss)`."""


def run_steps(step, params, state, batches):
    """Runs `step` over `batches`; the final parameters and state, and each step's loss as a float."""
    losses = []
    for batch in batches:
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return params, state, losses
