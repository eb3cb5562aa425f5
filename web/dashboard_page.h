// The dashboard page (web/dashboard.html), compiled into the binary at build time
// (web/CMakeLists.txt generates its definition): one HTML document with its script inline.
#pragma once

namespace strata::web {

// The page's text, a static string: any thread.
const char* DashboardPage();

}  // namespace strata::web
