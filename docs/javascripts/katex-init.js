// Typeset math with the KaTeX copy in docs/vendor/katex: the site loads nothing
// from the network.
//
// Two kinds of pages hold math:
//  * Markdown pages: pymdownx.arithmatex (generic mode) wraps every formula in
//    an element of class "arithmatex", as \( ... \) or \[ ... \].
//  * Notebook pages (mkdocs-jupyter): markdown cells and LaTeX outputs keep
//    the author's $ ... $ and $$ ... $$ as plain text.
// Dollar signs are only treated as math inside notebook cells, so a "$" in the
// prose of a normal page stays a dollar sign.
(function () {
  "use strict";

  const bracketDelimiters = [
    { left: "\\(", right: "\\)", display: false },
    { left: "\\[", right: "\\]", display: true },
  ];
  const notebookDelimiters = [
    { left: "$$", right: "$$", display: true },
    { left: "$", right: "$", display: false },
    ...bracketDelimiters,
  ];
  const notebookMath =
    ".jupyter-wrapper .jp-RenderedMarkdown, .jupyter-wrapper .jp-RenderedLatex";

  function typeset(root) {
    if (typeof renderMathInElement !== "function") {
      console.error("katex-init: KaTeX auto-render is not loaded");
      return;
    }
    // Errors in a formula are reported on the console (the site test fails on them).
    for (const el of root.querySelectorAll(".arithmatex")) {
      renderMathInElement(el, { delimiters: bracketDelimiters });
    }
    for (const el of root.querySelectorAll(notebookMath)) {
      renderMathInElement(el, { delimiters: notebookDelimiters });
    }
  }

  // Material's instant navigation swaps page content without reloading;
  // document$ emits for the first page and for every page after it.
  if (window.document$ && typeof window.document$.subscribe === "function") {
    window.document$.subscribe(() => typeset(document.body));
  } else if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", () => typeset(document.body));
  } else {
    typeset(document.body);
  }
})();
