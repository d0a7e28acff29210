"use strict";
const form = document.getElementById("login-form");
form.addEventListener("submit", async (event) => {
  event.preventDefault();
  const error = document.getElementById("login-error");
  error.hidden = true;
  const token = document.getElementById("token").value.trim();
  const response = await fetch("/api/login", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ token }),
    credentials: "same-origin",
  });
  if (response.ok) {
    window.location.replace(window.location.pathname === "/login" ? "/" : window.location.href);
    return;
  }
  let message = `log in refused (${response.status})`;
  try {
    message = (await response.json()).error || message;
  } catch (_) { /* not JSON */ }
  error.textContent = message;
  error.hidden = false;
});

// `epochmesh dashboard` opens /login#code=...: log in with it at once (the fragment never
// reaches the server's logs), then forget it.
const fromCli = new URLSearchParams(window.location.hash.slice(1)).get("code");
if (fromCli) {
  history.replaceState(null, "", window.location.pathname);
  document.getElementById("token").value = fromCli;
  form.requestSubmit();
}
