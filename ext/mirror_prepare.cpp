// Mirror files made ahead of the saves that take them over (a memory tier's first checkpoints): each laid out
// as a save of its tensors lays out its file, mapped, faulted in and pinned when the caller chooses, then
// kept mapped (MirrorFiles) for a save to recycle. A new file pinned by the copies of a save instead pins its
// pages while training runs on, and the training's launches wait on the driver's locks meanwhile.
#include <condition_variable>
#include <mutex>
#include <new>
#include <numeric>

#include "engine.hpp"

namespace ds {

namespace {

// One file's mirror, created under its temporary name and renamed onto `path` once mapped.
std::shared_ptr<MirrorFile> make_mirror(Storage& storage, const std::string& path, const Layout& layout,
                                        std::size_t block, int pin_device) {
  StorageFile file;
  if (int e = storage.create(path, &file))
    throw ErrorException(Error::os(e, "creating the folder of the mirror copy", file.folder));
  if (int e = storage.open(file, Access::Mapped)) {
    storage.discard(file);
    throw ErrorException(Error::os(e, "creating the mirror copy", file.temp));
  }
  try {
    auto map = std::make_shared<MirrorFile>(storage, file.fd, file.temp, align_up(layout.file_size, kPage),
                                            block, layout.data_start, pin_device);
    file.fd = -1;  // the mapping's now
    if (int e = storage.publish(file))
      throw ErrorException(Error::os(e, "renaming the mirror copy into place", path));
    storage.close(file);
    return map;
  } catch (const ErrorException&) {
    storage.discard(file);
    throw;
  } catch (const std::bad_alloc&) {
    storage.discard(file);
    throw ErrorException(Error::os(ENOMEM, "mapping the mirror copy", path));
  }
}

}  // namespace

std::size_t Engine::prepare_mirrors(const std::vector<SaveRequest>& files) {
  const Work work(this);  // close() must not stop the pinning threads under us
  const std::size_t chunk = cache_->chunk_bytes();
  std::vector<std::shared_ptr<MirrorFile>> made;
  for (const SaveRequest& f : files) {
    Layout layout = plan_layout(f.tensors, f.metadata, opts_.save.checksums && f.embed_checksums,
                                std::gcd(chunk, kBlockBytes));
    // A page of header room: the saves' headers vary with their metadata's plain values (an optimizer's
    // learning rate), and one longer than the file's would not fit its mapping.
    pad_header(layout, layout.data_start + kPage);
    made.push_back(make_mirror(*storage_, f.path, layout, chunk, cache_->pin_device()));
    mirrors_.put(f.path, made.back());  // kept from now on: keep_mirrors() unmaps it once its file is removed
  }
  // Every block of every file on the pinning threads at once, and waited for.
  struct Countdown {
    std::mutex mu;
    std::condition_variable cv;
    std::size_t left = 0;
  };
  auto left = std::make_shared<Countdown>();
  for (const auto& map : made) left->left += map->blocks();
  for (const auto& map : made)
    for (std::size_t i = 0; i < map->blocks(); ++i)
      pinners_.submit([map, i, left] {
        map->prepare_block_once(i);
        std::lock_guard<std::mutex> lock(left->mu);
        if (--left->left == 0) left->cv.notify_all();
      });
  std::unique_lock<std::mutex> lock(left->mu);
  left->cv.wait(lock, [&] { return left->left == 0; });
  return made.size();
}

}  // namespace ds
