/* Keyboard access to the controls plotly draws in the book's static figures.
 *
 * plotly.js draws an updatemenu's buttons (the widgets' "▶ play") and an animation slider as SVG
 * groups with mouse listeners only: no tab stop, no role, no name. This script, served by the site
 * itself (book/_config.yml, html_js_files), gives every one of them a tab stop, a role and a name,
 * and the keys a reader expects:
 *
 *   g.updatemenu-button, g.updatemenu-header, g.updatemenu-dropdown-button  role="button";
 *       Enter or Space sends the 'click' that plotly listens for on the group itself (plotly's
 *       updatemenus/draw.js). A button of a menu that shows its active choice says so with
 *       aria-pressed; a dropdown's header says whether it is open (aria-expanded), choosing an
 *       option or pressing Escape closes it and puts the focus back on the header.
 *   g.slider-group (one per slider)  role="slider" with aria-valuemin/max/now/valuetext;
 *       ArrowLeft/ArrowDown, ArrowRight/ArrowUp, PageDown, PageUp, Home and End choose a step,
 *       which is then applied as a click on the slider would: the slider's `active` set, then the
 *       step's own method run with its own args (Plotly.animate(gd, ["name"], {...}) for frames).
 *
 * plotly redraws its SVG on every frame, relayout and restyle, so the attributes are (re)applied
 * after each change: a MutationObserver and plotly's own events schedule one pass per animation
 * frame. No dependency besides plotly.js itself, which the page already loads.
 */
(function () {
  "use strict";

  var FOCUS_COLOUR = "#0072B2"; // the course's blue (Okabe-Ito), as the favicon
  var STYLE =
    ".js-plotly-plot g[data-onemask-key]:focus { outline: none; }\n" +
    ".js-plotly-plot g[data-onemask-key]:focus-visible { outline: 3px solid " + FOCUS_COLOUR + "; outline-offset: 2px; }\n" +
    ".js-plotly-plot g[data-onemask-key]:focus-visible rect.updatemenu-item-rect,\n" +
    ".js-plotly-plot g[data-onemask-key]:focus-visible rect.slider-rail-rect,\n" +
    ".js-plotly-plot g[data-onemask-key]:focus-visible rect.slider-grip-rect {\n" +
    "  stroke: " + FOCUS_COLOUR + " !important; stroke-width: 3px !important; }\n";

  // A menu of type "buttons" draws g.updatemenu-button groups inside its g.updatemenu-header-group;
  // a dropdown draws its header (which opens it) as g.updatemenu-header there, and, while open,
  // its options as g.updatemenu-dropdown-button in the container's one shared dropdown group.
  var BUTTONS = "g.updatemenu-button, g.updatemenu-header, g.updatemenu-dropdown-button";
  var SLIDERS = "g.slider-group";

  function clean(text) {
    return String(text == null ? "" : text).replace(/<[^>]*>/g, " ").replace(/\s+/g, " ").trim();
  }

  // A button's name: what it does when it is plotly's play/pause idiom, else its visible text
  // without the leading symbols (so "▶ play" reads "Play animation", "causal (GPT)" stays).
  function buttonName(el) {
    var shown = clean(el.textContent);
    var bare = shown.replace(/^[^\p{L}\p{N}]+/u, "");
    var opts = el.__data__ || {};
    if (opts.method === "animate" && Array.isArray(opts.args)) {
      var frames = opts.args[0];
      if (frames == null) return "Play animation";
      if (Array.isArray(frames) && frames.length === 1 && frames[0] == null) return "Pause animation";
    }
    if (/^(play|start)$/i.test(bare)) return "Play animation";
    if (/^(pause|stop)$/i.test(bare)) return "Pause animation";
    return bare || shown || "Figure control";
  }

  function setAttr(el, name, value) {
    value = String(value);
    if (el.getAttribute(name) !== value) el.setAttribute(name, value);
  }

  // The header group a button belongs to: its ancestor, or for an open dropdown's option the
  // header group of the menu the shared dropdown group is showing (updatemenu-active-index).
  function headerGroup(el) {
    var header = el.closest("g.updatemenu-header-group");
    var list = el.closest("g.updatemenu-dropdown-button-group");
    var container = el.closest("g.updatemenu-container");
    if (header || !list || !container) return header;
    var shown = list.getAttribute("updatemenu-active-index");
    return Array.prototype.find.call(container.querySelectorAll("g.updatemenu-header-group"), function (g) {
      return g.__data__ && String(g.__data__._index) === shown;
    }) || null;
  }

  function menuOpts(el) {
    var header = headerGroup(el);
    var opts = header && header.__data__; // plotly (d3) binds it to the menu's full-layout options
    return opts && Array.isArray(opts.buttons) ? opts : null;
  }

  function click(el) {
    el.dispatchEvent(new MouseEvent("click", { bubbles: true, cancelable: true, view: window }));
  }

  function sliderOpts(group) {
    var opts = group.__data__; // plotly (d3) binds each slider group to its full-layout options
    return opts && Array.isArray(opts.steps) ? opts : null;
  }

  function visibleSteps(opts) {
    if (Array.isArray(opts._visibleSteps)) return opts._visibleSteps.map(function (s) { return s._index; });
    var out = [];
    opts.steps.forEach(function (s, i) { if (s.visible !== false) out.push(i); });
    return out;
  }

  function sliderName(opts) {
    var prefix = clean((opts.currentvalue || {}).prefix).replace(/[:\s]+$/, "");
    return prefix || "Animation frame";
  }

  function syncSlider(group, opts) {
    var steps = visibleSteps(opts);
    var position = Math.max(0, steps.indexOf(opts.active));
    var step = opts.steps[steps[position]] || {};
    var current = opts.currentvalue || {};
    var label = clean(step.label != null ? step.label : step.value);
    setAttr(group, "aria-valuemin", 1);
    setAttr(group, "aria-valuemax", steps.length);
    setAttr(group, "aria-valuenow", position + 1);
    setAttr(group, "aria-valuetext",
      clean((current.prefix || "") + label + (current.suffix || "")) + ", " + (position + 1) + " of " + steps.length);
  }

  function enhanceGraph(gd) {
    if (!gd._onemaskHooked && typeof gd.on === "function") {
      gd._onemaskHooked = true;
      ["plotly_afterplot", "plotly_sliderchange", "plotly_animatingframe", "plotly_animated",
        "plotly_buttonclicked", "plotly_relayout"].forEach(function (name) { gd.on(name, schedule); });
    }
    gd.querySelectorAll(BUTTONS).forEach(function (el, i) {
      setAttr(el, "data-onemask-key", "button-" + i);
      setAttr(el, "tabindex", 0);
      setAttr(el, "role", "button");
      setAttr(el, "aria-label", buttonName(el));
      var menu = menuOpts(el);
      if (el.matches("g.updatemenu-header")) {
        var list = el.closest(".updatemenu-container").querySelector(".updatemenu-dropdown-button-group");
        setAttr(el, "aria-haspopup", "true");
        setAttr(el, "aria-expanded", !!menu && !!list && list.getAttribute("updatemenu-active-index") === String(menu._index));
      } else if (menu && menu.type === "buttons" && menu.showactive && el.__data__) {
        setAttr(el, "aria-pressed", menu.active === el.__data__._index);
      }
    });
    gd.querySelectorAll(SLIDERS).forEach(function (group, i) {
      var opts = sliderOpts(group);
      if (!opts || !opts.steps.length) return;
      setAttr(group, "data-onemask-key", "slider-" + i);
      setAttr(group, "tabindex", 0);
      setAttr(group, "role", "slider");
      setAttr(group, "aria-orientation", "horizontal");
      setAttr(group, "aria-label", sliderName(opts));
      syncSlider(group, opts);
    });
  }

  var scheduled = false;
  function schedule() {
    if (scheduled) return;
    scheduled = true;
    window.requestAnimationFrame(function () {
      scheduled = false;
      document.querySelectorAll(".js-plotly-plot").forEach(enhanceGraph);
    });
  }

  // What a click on the slider does (plotly's sliders/draw.js): set `active`, then run the step's
  // own command. Setting `active` through relayout keeps gd.layout and the drawn grip in step.
  function chooseStep(gd, group, opts, index) {
    var Plotly = window.Plotly;
    var step = opts.steps[index];
    if (!Plotly || !step || index === opts.active) return;
    var update = {};
    update["sliders[" + opts._index + "].active"] = index;
    var args = Array.isArray(step.args) ? step.args : [];
    Plotly.relayout(gd, update).then(function () {
      if (step.execute === false) return null;
      switch (step.method) {
        case "animate":
          return Plotly.animate(gd, args[0], Object.assign(
            { mode: "immediate", frame: { duration: 0, redraw: true }, transition: { duration: 0 } }, args[1] || {}));
        case "restyle": return Plotly.restyle(gd, args[0], args[1]);
        case "relayout": return Plotly.relayout(gd, args[0]);
        case "update": return Plotly.update(gd, args[0], args[1], args[2]);
        default: return null; // "skip": the slider only moves
      }
    }).then(schedule, schedule);
    syncSlider(group, Object.assign({}, opts, { active: index }));
  }

  function onSliderKey(event, group) {
    var gd = group.closest(".js-plotly-plot");
    var opts = sliderOpts(group);
    if (!gd || !opts) return;
    var steps = visibleSteps(opts);
    var position = Math.max(0, steps.indexOf(opts.active));
    var page = Math.max(1, Math.round(steps.length / 10));
    var target = {
      ArrowLeft: position - 1, ArrowDown: position - 1, ArrowRight: position + 1, ArrowUp: position + 1,
      PageDown: position - page, PageUp: position + page, Home: 0, End: steps.length - 1
    }[event.key];
    if (target === undefined) return;
    event.preventDefault(); // the page must not scroll under the slider
    target = Math.min(steps.length - 1, Math.max(0, target));
    chooseStep(gd, group, opts, steps[target]);
  }

  document.addEventListener("keydown", function (event) {
    var el = event.target;
    if (!(el instanceof Element) || !el.hasAttribute("data-onemask-key") || event.altKey || event.ctrlKey || event.metaKey) return;
    if (el.matches(BUTTONS)) {
      var group = headerGroup(el);
      var header = group && group.querySelector("g.updatemenu-header");
      var option = el.matches("g.updatemenu-dropdown-button");
      if (event.key === "Escape" && header && header.getAttribute("aria-expanded") === "true") {
        click(header); // plotly's header click folds an open dropdown
        header.focus();
        return;
      }
      if (event.key !== "Enter" && event.key !== " ") return;
      event.preventDefault(); // Space must not scroll the page
      if (event.repeat) return;
      click(el);
      if (option && header) header.focus(); // the chosen option is removed as the dropdown folds
      schedule();
    } else if (el.matches(SLIDERS)) {
      onSliderKey(event, el);
    }
  });

  function install() {
    var style = document.createElement("style");
    style.id = "onemask-a11y-style";
    style.textContent = STYLE;
    document.head.appendChild(style);
    new MutationObserver(schedule).observe(document.documentElement, { childList: true, subtree: true });
    schedule();
  }

  if (document.head) install(); // loaded from the page's <head>, before the figures' scripts run
  else document.addEventListener("DOMContentLoaded", install);
})();
