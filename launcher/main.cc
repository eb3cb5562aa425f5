#include <csignal>

#include "launcher/commands.h"

int main(int argc, char** argv) {
  // A peer that dies closes its sockets; writing to one must come back as an error that names the
  // peer (see runtime/comm), not kill this process with SIGPIPE.
  std::signal(SIGPIPE, SIG_IGN);
  return strata::launcher::Main(argc, argv);
}
