#include "launcher/commands.h"

int main(int argc, char** argv) { return strata::launcher::Main(argc, argv); }
