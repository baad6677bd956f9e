// Folder trees removed without following a link: nanotron_datastates.trust.remove_tree's work, in C++ so that
// a committer thread's removal of an old step (a hundred folders) holds no GIL a training thread needs.
#pragma once

#include <string>
#include <vector>

namespace ds {

// Removes the folder root/parts[0]/.../parts[n-1] and everything in it. `root` is opened as given; every
// component below it, and every folder inside, is opened from its parent's descriptor without following a
// link (a link met inside is removed itself, never its target). Entries go last listed first; what is gone
// already counts as removed. One descriptor open at a time, no recursion: any depth. False at the first
// thing that cannot be removed (what is left stays): the folder missing or a link, an entry a file system
// refuses to remove, a folder changed meanwhile (a file added, swapped for a link, moved away while
// walked). `parts` are checked by the caller: no empty, `.`, `..` or `/`-holding part. Never throws.
bool remove_tree(const std::string& root, const std::vector<std::string>& parts) noexcept;

}  // namespace ds
