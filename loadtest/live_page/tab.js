// Added to Locust's web UI by loadtest/live.py: while the "LLM batching (live)" tab is selected, the live view
// (llm-live/, served by the same Locust process) fills the tab's panel. Locust's React app draws nothing for an
// extended tab without a table, so the page goes after the tab bar, in the same container as Locust's own panels.
"use strict";

(function () {
  const TITLE = document.currentScript.dataset.title;
  let frame = null;

  function selected() {
    const tab = document.querySelector('main [role="tablist"] [role="tab"][aria-selected="true"]');
    return tab !== null && tab.textContent.trim() === TITLE;
  }

  function sync() {
    const tabs = document.querySelector('main [role="tablist"]');
    const container = tabs && tabs.closest(".MuiContainer-root");
    if (container && selected()) {
      if (frame === null) {
        frame = document.createElement("iframe");
        frame.id = "llm-live-frame";
        frame.title = TITLE;
        frame.src = "llm-live/?embed=1";
        frame.style.cssText = "display:block;width:100%;height:900px;border:0;margin-top:8px;";
      }
      if (frame.parentNode !== container) container.appendChild(frame);
    } else if (frame !== null && frame.parentNode) {
      frame.remove();
    }
  }

  // The page's height, so that Locust's page scrolls and not a frame inside it.
  function fit() {
    const doc = frame && frame.parentNode && frame.contentDocument;
    if (doc && doc.documentElement) frame.style.height = `${doc.documentElement.scrollHeight + 8}px`;
  }

  new MutationObserver(sync).observe(document.body, {
    childList: true, subtree: true, attributes: true, attributeFilter: ["aria-selected"],
  });
  setInterval(fit, 500);
  sync();
})();
