"""The controls plotly draws in the book's static figures work from the keyboard alone.

plotly draws updatemenu buttons (the widgets' "▶ play") and animation sliders as bare SVG;
book/_assets/onemask-a11y.js gives them tab stops, roles, names and keys. These tests press only
keys: Tab reaches the control from the top of the page, Enter or Space presses a button, and the
arrows, Home and End move a slider to a step whose frame the figure then shows.
"""

import pytest

# tile_schedule's animation (lesson 05) has the fewest frames (5 x 400 ms), so the test waits least.
ANIMATED_PAGE = "lessons/05-attention-kernels.html"
MENU_PAGE = "lessons/01-masking-equation.html"  # mask_explorer's row of mask buttons
MAX_TABS = 400  # a lesson page has ~100-200 tab stops before its figures

# What the figure shows, read back from plotly: the slider's active step, what the slider tells
# assistive technology, and whether every trace holds the z of the active step's frame.
SHOWN = """gd => {
    const slider = gd._fullLayout.sliders[0], group = gd.querySelector('g.slider-group');
    const frame = gd._transitionData._frameHash[slider.steps[slider.active].args[0][0]];
    const showsFrame = frame.data.every((trace, j) =>
        JSON.stringify(gd.data[frame.traces ? frame.traces[j] : j].z) === JSON.stringify(trace.z));
    return {active: slider.active, last: slider.steps.length - 1, showsFrame: showsFrame,
            valuenow: group.getAttribute('aria-valuenow'), valuetext: group.getAttribute('aria-valuetext'),
            focused: document.activeElement === group};
}"""
STILL = """gd => !gd._transitionData._animationRaf
    && gd._fullLayout.sliders[0].active === gd._fullLayout.sliders[0].steps.length - 1"""


def open_page(book_server, page_with_log, path):
    page, log = page_with_log(book_server)
    page.goto(f"{book_server}/{path}", timeout=60_000)
    page.wait_for_load_state("networkidle", timeout=60_000)
    return page, log


def tab_to(page, target, key="Tab", limit=MAX_TABS) -> int:
    """Press `key` until `target` (an element handle) has focus; the number of presses."""
    for presses in range(1, limit + 1):
        page.keyboard.press(key)
        if page.evaluate("el => document.activeElement === el", target):
            return presses
    pytest.fail(f"{limit} presses of {key} never focused {target.evaluate('el => el.outerHTML.slice(0, 200)')}")


def test_animation_plays_and_steps_from_the_keyboard(book_server, page_with_log):
    page, log = open_page(book_server, page_with_log, ANIMATED_PAGE)
    figure = page.locator(".js-plotly-plot").filter(has=page.locator("g.slider-group[role=slider]")).first
    gd = figure.element_handle(timeout=30_000)
    at_load = gd.evaluate(SHOWN)
    page.wait_for_timeout(1_500)  # longer than a frame: an animation that started on load would have moved
    still = gd.evaluate(SHOWN)
    assert still["active"] == at_load["active"] and still["showsFrame"], "the animation moved without being asked"
    assert not gd.evaluate("gd => !!gd._transitionData._animationRaf")

    play = figure.locator("g.updatemenu-button").first.element_handle()
    assert play.evaluate(
        "el => [el.getAttribute('role'), el.getAttribute('tabindex'), el.getAttribute('aria-label')]"
    ) == ["button", "0", "Play animation"]
    tab_to(page, play)
    before = gd.evaluate(SHOWN)
    assert before["valuenow"] == str(before["active"] + 1)
    page.keyboard.press("Enter")  # plays from the first frame: the slider leaves the step it showed
    page.wait_for_function(f"gd => gd._fullLayout.sliders[0].active !== {before['active']}", arg=gd, timeout=10_000)
    page.wait_for_function(STILL, arg=gd, timeout=30_000)  # and plays through to the last step
    assert gd.evaluate(SHOWN)["showsFrame"]

    slider = figure.locator("g.slider-group").first.element_handle()
    tab_to(page, slider, "Shift+Tab", limit=3)  # plotly draws the slider just before the buttons
    for key, active in [
        ("Home", 0),
        ("ArrowRight", 1),
        ("ArrowRight", 2),
        ("ArrowLeft", 1),
        ("End", before["last"]),
        ("ArrowRight", before["last"]),
    ]:
        page.keyboard.press(key)
        page.wait_for_function(
            f"gd => gd._fullLayout.sliders[0].active === {active} && !gd._transitionData._animationRaf "
            f"&& gd.querySelector('g.slider-group').getAttribute('aria-valuenow') === '{active + 1}'",
            arg=gd,
            timeout=10_000,
        )
        shown = gd.evaluate(SHOWN)
        assert shown["showsFrame"], f"after {key} the figure does not show step {active}'s frame"
        assert shown["valuetext"].endswith(f"{active + 1} of {before['last'] + 1}") and shown["focused"]
    assert log.page_errors == [] and log.console_errors == []
    page.context.close()


def test_menu_button_presses_with_space_and_says_it_is_pressed(book_server, page_with_log):
    page, log = open_page(book_server, page_with_log, MENU_PAGE)
    figure = page.locator(".js-plotly-plot").filter(has=page.locator("g.updatemenu-button[role=button]")).first
    gd = figure.element_handle(timeout=30_000)
    bidirectional = figure.locator("g.updatemenu-button[aria-label='bidirectional (BERT)']").element_handle()
    causal = figure.locator("g.updatemenu-button[aria-label='causal (GPT)']").element_handle()
    assert [b.get_attribute("aria-pressed") for b in (bidirectional, causal)] == ["false", "true"]
    before = gd.evaluate("gd => JSON.stringify(gd.data[2].z)")

    tab_to(page, bidirectional)
    scrolled = page.evaluate("() => window.scrollY")
    page.keyboard.press(" ")
    page.wait_for_function("([gd, old]) => JSON.stringify(gd.data[2].z) !== old", arg=[gd, before], timeout=10_000)
    after = gd.evaluate("gd => gd.data[2].z")
    assert any(after[0][j] > 0 for j in range(1, len(after)))  # bidirectional: the first token now sees ahead
    page.wait_for_function("el => el.getAttribute('aria-pressed') === 'true'", arg=bidirectional, timeout=5_000)
    assert causal.get_attribute("aria-pressed") == "false"
    assert page.evaluate("() => window.scrollY") == scrolled  # Space pressed the button, not scrolled the page
    assert log.page_errors == [] and log.console_errors == []
    page.context.close()
